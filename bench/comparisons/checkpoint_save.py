"""checkpoint_save: seconds the loop is blocked by a save: SHARDED (synchronous, asynchronous) vs FULL state dict"""

from __future__ import annotations

import statistics

from common import SIZES, Bench, _row


def measure(bench: Bench) -> dict:
    """Seconds the loop is blocked by one save: SHARDED (DCP) synchronous and asynchronous
    (checkpoint.async_save: blocked while the state is copied to host memory, and while a previous save
    still writes), and FULL state dict."""
    size = SIZES["tiny" if bench.quick else "medium"]
    contenders = {
        "sharded": ("fsdp2_full_shard.yaml", {}),
        "sharded_async": ("fsdp2_full_shard.yaml", {"checkpoint.async_save": "true"}),
        "full": ("fsdp2_shard_grad_op.yaml", {}),
    }
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(bench.repeats):
        for name, (config, extra) in contenders.items():
            settings = {"train.max_steps": 6, "checkpoint.save_every_steps": 2, **extra}
            metrics = bench.finetune_run(f"save-{name}-{repeat}", size, config, **settings)
            results[name].extend(metrics["checkpoint_seconds"])
    median = {name: statistics.median(values) for name, values in results.items()}
    return {
        "metric": "seconds_blocked_per_save",
        "size": size.name,
        "runs": results,
        "median": median,
        "async_over_sync": median["sharded_async"] / median["sharded"],
        "target_async_over_sync": 0.3,
    }


def rows(save: dict) -> list[str]:
    median = save["median"]
    return [
        _row(
            f"checkpoint save, s blocked ({save['size']})", f"SHARDED {median['sharded']:.2f}",
            f"FULL {median['full']:.2f}",
        ),
        _row(
            f"asynchronous checkpoint save, s blocked ({save['size']}, SHARDED)", f"{median['sharded_async']:.3f}",
            f"{median['sharded']:.3f} (synchronous)", f"{save['async_over_sync']:.2f}",
            f"<= {save['target_async_over_sync']}",
        ),
    ]  # fmt: skip
