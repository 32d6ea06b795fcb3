"""export: `finetune export` vs `accelerate merge-weights` on one SHARDED checkpoint: time, peak RSS"""

from __future__ import annotations

import shutil
import sys

from common import MIB, SIZES, Bench, _medians, _row, _timed_peak_rss


def measure(bench: Bench) -> dict:
    """`finetune export` vs `accelerate merge-weights` on one SHARDED checkpoint: time and peak RSS."""
    size = SIZES["tiny" if bench.quick else "export"]
    bench.finetune_run(
        "export-source", size, "fsdp2_full_shard.yaml",
        **{"train.max_steps": 1, "checkpoint.save_every_steps": 1, "train.micro_batch_size": 1},
    )  # fmt: skip
    checkpoint = bench.work / "runs" / "export-source" / "checkpoints" / "step_1"
    shard_size = "20MB" if bench.quick else "200MB"
    contenders = {
        "finetune_export": lambda out: [sys.executable, "-m", "finetune", "export", str(checkpoint), str(out),
                                        "--max-shard-size", shard_size],
        "accelerate_merge_weights": lambda out: [
            sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
            str(checkpoint / "pytorch_model_fsdp_0"), str(out),
        ],
    }  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for repeat in range(bench.repeats):
        for name, command in contenders.items():
            out = bench.work / "exports" / f"{name}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak = _timed_peak_rss(command(out))
            largest = max(p.stat().st_size for p in out.glob("*.safetensors"))
            runs[name].append({"seconds": seconds, "peak_rss_bytes": peak, "largest_file_bytes": largest})
    # The fixed overhead: the same exporter on the tiny model (interpreter, torch, transformers).
    tiny_checkpoint = checkpoint
    if not bench.quick:
        bench.finetune_run(
            "export-tiny", SIZES["tiny"], "fsdp2_full_shard.yaml",
            **{"train.max_steps": 1, "checkpoint.save_every_steps": 1},
        )  # fmt: skip
        tiny_checkpoint = bench.work / "runs" / "export-tiny" / "checkpoints" / "step_1"
    overhead_out = bench.work / "exports" / "overhead"
    shutil.rmtree(overhead_out, ignore_errors=True)
    _, overhead = _timed_peak_rss(
        [sys.executable, "-m", "finetune", "export", str(tiny_checkpoint), str(overhead_out)]
    )
    median = _medians(runs)
    ours = median["finetune_export"]
    return {
        "size": size.name,
        "runs": runs,
        "median": median,
        "fixed_overhead_rss_bytes": overhead,
        "peak_over_largest_shard": (ours["peak_rss_bytes"] - overhead) / ours["largest_file_bytes"],
        "target_peak_over_largest_shard": 1.2,
        "time_ratio_vs_merge_weights": ours["seconds"] / median["accelerate_merge_weights"]["seconds"],
    }


def rows(export: dict) -> list[str]:
    ours, theirs = export["median"]["finetune_export"], export["median"]["accelerate_merge_weights"]
    return [
        _row(
            f"export time, s ({export['size']})", f"{ours['seconds']:.1f}", f"{theirs['seconds']:.1f} (merge-weights)",
            f"{export['time_ratio_vs_merge_weights']:.2f}", "<= 1",
        ),
        _row(
            "export peak RSS, MiB", f"{ours['peak_rss_bytes'] / MIB:.0f}",
            f"{theirs['peak_rss_bytes'] / MIB:.0f} (merge-weights)",
            f"(peak - {export['fixed_overhead_rss_bytes'] / MIB:.0f} MiB overhead) / largest shard "
            f"{ours['largest_file_bytes'] / MIB:.0f} MiB = {export['peak_over_largest_shard']:.2f}",
            f"<= {export['target_peak_over_largest_shard']}",
        ),
    ]  # fmt: skip
