"""scaling: step time and per-rank memory: 3 sizes x 1/2 processes x full shard/shard-grad-op/DDP"""

from __future__ import annotations

from common import MIB, SIZES, Bench, _parameters, _steady_median


def measure(bench: Bench) -> dict:
    """Step time and per-rank memory across sizes, process counts and strategies."""
    sizes = ["tiny"] if bench.quick else ["tiny", "small", "medium"]
    strategies = {
        "full_shard": "fsdp2_full_shard.yaml",
        "shard_grad_op": "fsdp2_shard_grad_op.yaml",
        "ddp": "ddp.yaml",
    }
    # A quick run (the test suite's) measures one process and 2 with and without sharding, not every pairing.
    quick = {(1, "ddp"), (2, "full_shard"), (2, "ddp")}
    rows = []
    for size_name in sizes:
        for processes in (1, 2):
            for strategy, config in strategies.items():
                if bench.quick and (processes, strategy) not in quick:
                    continue
                metrics = bench.finetune_run(
                    f"scale-{size_name}-{processes}-{strategy}", SIZES[size_name], config, processes,
                    **{"train.max_steps": min(bench.steps, 10), "train.micro_batch_size": 16 // processes},
                )  # fmt: skip
                memory = {key.split("/")[-1]: value for key, value in metrics["memory"].items()}
                rows.append({
                    "size": size_name, "parameters": _parameters(bench.model(SIZES[size_name])),
                    "processes": processes,
                    "strategy": strategy if processes > 1 or strategy != "ddp" else "single",
                    "step_seconds": _steady_median(metrics["step_seconds"]),
                    "rank0_bytes": memory,
                })  # fmt: skip
    return {"global_batch_rows": 16, "rows": rows}


def rows(scaling: dict) -> list[str]:
    lines = [
        "Scaling (global batch 16 rows x 128 tokens; rank 0 bytes measured in step 1):",
        "",
        "| size | params | processes | strategy | step s | params MiB | grads MiB | optimizer MiB | activations MiB "
        "| step peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in scaling["rows"]:
        mem = row["rank0_bytes"]
        lines.append(
            f"| {row['size']} | {row['parameters'] or 0:,} | {row['processes']} | {row['strategy']} | "
            f"{row['step_seconds']:.3f} | {mem.get('parameters', 0) / MIB:.1f} | "
            f"{mem.get('gradients', 0) / MIB:.1f} | "
            f"{mem.get('optimizer_state', 0) / MIB:.1f} | {mem.get('activations', 0) / MIB:.1f} | "
            f"{mem.get('step_peak', 0) / MIB:.0f} |"
        )
    return lines
