"""merge: `finetune export --merge` vs PEFT's merge_and_unload() + save_pretrained: time, peak RSS"""

from __future__ import annotations

import shutil
import sys

from common import LORA, MIB, REPO, SIZES, Bench, _medians, _parameters, _row, _timed_peak_rss


def measure(bench: Bench) -> dict:
    """`finetune export --merge` against PEFT's merge_and_unload() + save_pretrained on one adapter of
    a model of several hundred million parameters: time and peak RSS."""
    size = SIZES["tiny" if bench.quick else "export"]
    bench.finetune_run(
        "merge-source", size, "fsdp2_full_shard.yaml",
        **{**LORA, "train.max_steps": 1, "checkpoint.save_every_steps": 1, "train.micro_batch_size": 1,
           "output.export": "true"},
    )  # fmt: skip
    source = bench.work / "runs" / "merge-source"
    shard_size = "20MB" if bench.quick else "200MB"
    contenders = {
        "finetune_export_merge": lambda out: [
            sys.executable, "-m", "finetune", "export", str(source / "checkpoints" / "step_1"), str(out),
            "--merge", "--max-shard-size", shard_size,
        ],
        "peft_merge_and_unload": lambda out: [
            sys.executable, str(REPO / "bench" / "peft_merge.py"), str(bench.model(size)), str(source / "final"),
            str(out), shard_size,
        ],
    }  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for repeat in range(bench.repeats):
        for name, command in contenders.items():
            out = bench.work / "exports" / f"{name}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak = _timed_peak_rss(command(out))
            runs[name].append({"seconds": seconds, "peak_rss_bytes": peak})
    median = _medians(runs)
    ours, theirs = median["finetune_export_merge"], median["peft_merge_and_unload"]
    return {
        "size": size.name,
        "parameters": _parameters(bench.model(size)),
        "runs": runs,
        "median": median,
        "peak_ratio": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
        "target_peak_ratio": 0.5,
        "time_ratio": ours["seconds"] / theirs["seconds"],
    }


def rows(merge: dict) -> list[str]:
    ours, peft = merge["median"]["finetune_export_merge"], merge["median"]["peft_merge_and_unload"]
    return [
        _row(
            f"merged export, s ({merge['size']}, {merge['parameters']:,} parameters)", f"{ours['seconds']:.1f}",
            f"{peft['seconds']:.1f} (merge_and_unload + save_pretrained)", f"{merge['time_ratio']:.2f}",
        ),
        _row(
            "merged export peak RSS, MiB", f"{ours['peak_rss_bytes'] / MIB:.0f}",
            f"{peft['peak_rss_bytes'] / MIB:.0f}",
            f"{merge['peak_ratio']:.2f}", f"<= {merge['target_peak_ratio']}",
        ),
    ]  # fmt: skip
