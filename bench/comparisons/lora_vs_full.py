"""lora_vs_full: LoRA vs full fine-tuning (FSDP2): step time, rank 0 memory, checkpoint bytes"""

from __future__ import annotations

from common import LORA, MIB, Bench, _medians, _row, _steady_median


def measure(bench: Bench) -> dict:
    """LoRA against full fine-tuning on the same model, data and FSDP2 launch: step time, rank 0's
    measured memory, and the bytes of one checkpoint."""
    size = bench.train_size
    save = {"checkpoint.save_every_steps": bench.steps}
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    for repeat in range(bench.repeats):
        for name, overrides in (("full", save), ("lora", {**save, **LORA})):
            metrics = bench.finetune_run(f"{name}-{repeat}", size, "fsdp2_full_shard.yaml", **overrides)
            checkpoint = bench.work / "runs" / f"{name}-{repeat}" / "checkpoints" / f"step_{bench.steps}"
            runs[name].append({
                "step_seconds": _steady_median(metrics["step_seconds"]),
                "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()),
                **{key.split("/")[-1]: value for key, value in metrics["memory"].items()},
            })  # fmt: skip
    median = _medians(runs)
    full, lora = median["full"], median["lora"]
    return {
        "size": size.name,
        "lora": LORA,
        "runs": runs,
        "median": median,
        "step_time_ratio": lora["step_seconds"] / full["step_seconds"],
        "peak_ratio": lora["step_peak"] / full["step_peak"],
        "checkpoint_bytes_ratio": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
    }


def rows(lora: dict) -> list[str]:
    full, adapted = lora["median"]["full"], lora["median"]["lora"]
    return [
        _row(
            f"LoRA r={lora['lora']['peft.r']} vs full, step s ({lora['size']}, FSDP2)",
            f"{adapted['step_seconds']:.3f}",
            f"{full['step_seconds']:.3f} (full)", f"{lora['step_time_ratio']:.2f}",
        ),
        _row(
            "LoRA vs full, rank 0 step peak MiB", f"{adapted['step_peak'] / MIB:.0f}",
            f"{full['step_peak'] / MIB:.0f} (full)", f"{lora['peak_ratio']:.2f}",
        ),
        _row(
            "LoRA vs full, checkpoint MiB", f"{adapted['checkpoint_bytes'] / MIB:.2f}",
            f"{full['checkpoint_bytes'] / MIB:.2f} (full)", f"{lora['checkpoint_bytes_ratio']:.3f}",
        ),
    ]  # fmt: skip
