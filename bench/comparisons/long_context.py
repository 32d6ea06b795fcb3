"""long_context: sequence parallelism (sp=2) against one process on long rows, and activation offload"""

from __future__ import annotations

import statistics

from common import MIB, SIZES, Bench, _row, _steady_rate


def measure(bench: Bench) -> dict:
    """Rows of `length` tokens (the demo's samples packed into them, so every slice boundary cuts a sample), one
    row a step, the bench model in fp32 on CPU, interleaved repetitions:

    - `one`: FSDP2 on one process; `sp2`: the same rows split over 2 processes (accelerate_configs/
      sequence_parallel.yaml): rank 0's bytes saved for backward and step peak (step 1), trained tokens/s;
    - `checkpointed` vs `offloaded`: one process with full activation checkpointing, without and with
      train.activation_offload: bytes saved for backward on the device, tokens/s.

    The longest row each fits is read off the measured bytes per token: within the activation memory one process
    needs at `length`, sp=2 fits `length` x (one's bytes / sp2's bytes) tokens. A quick run (the test suite's)
    measures sequence parallelism alone (offload has tests of its own)."""
    size = SIZES["tiny" if bench.quick else "small"]
    length, steps = (1024, 3) if bench.quick else (8192, 6)
    common = {
        "train.max_steps": steps, "train.micro_batch_size": 1, "data.max_length": length,
        "model.attn_implementation": "varlen", "model.config_overrides.max_position_embeddings": length,
    }  # fmt: skip
    contenders = {
        "one": ("fsdp2_full_shard.yaml", 1, {}),
        "sp2": ("sequence_parallel.yaml", 2, {}),
        "checkpointed": ("fsdp2_full_shard.yaml", 1, {"train.activation_checkpointing": "full"}),
        "offloaded": (
            "fsdp2_full_shard.yaml", 1, {"train.activation_checkpointing": "full", "train.activation_offload": "true"}
        ),
    }  # fmt: skip
    if bench.quick:
        contenders = {name: contenders[name] for name in ("one", "sp2")}
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for repeat in range(bench.repeats):
        for name, (config, processes, extra) in contenders.items():
            launch = ("--parallelism_config_sp_size", "2", "--fsdp_cpu_ram_efficient_loading", "false")
            metrics = bench.finetune_run(
                f"long-{name}-{repeat}", size, config, processes, launch_args=launch if name == "sp2" else (),
                **common, **extra,
            )  # fmt: skip
            runs[name].append({
                "activations": metrics["memory"]["memory/rank0/activations"],
                "step_peak": metrics["memory"]["memory/rank0/step_peak"],
                "tokens_per_second": _steady_rate(metrics["target_tokens"], metrics["step_seconds"]),
            })  # fmt: skip
    median = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]} for name, results in runs.items()
    }
    one, sp2 = median["one"], median["sp2"]
    offload = {}
    if "offloaded" in median:
        offloaded, checkpointed = median["offloaded"], median["checkpointed"]
        offload = {
            "offload_activation_ratio": offloaded["activations"] / checkpointed["activations"],
            "offload_tokens_per_second_ratio": offloaded["tokens_per_second"] / checkpointed["tokens_per_second"],
        }
    return {
        "shape": {"size": size.name, "row_tokens": length, "dtype": "float32", "sequence_parallel": 2},
        "median": median,
        "activation_ratio": sp2["activations"] / one["activations"],
        "step_peak_ratio": sp2["step_peak"] / one["step_peak"],
        "tokens_per_second_ratio": sp2["tokens_per_second"] / one["tokens_per_second"],
        "longest_row": {"one": length, "sp2": int(length * one["activations"] / sp2["activations"])},
        **offload,
        "targets": {"activation_ratio": 0.6},
    }


def rows(long: dict) -> list[str]:
    shape, median = long["shape"], long["median"]
    where = f"{shape['row_tokens']:,}-token rows, {shape['size']} model, fp32"
    one, sp2 = median["one"], median["sp2"]
    rows = [
        _row(
            f"sequence parallel sp=2, rank 0 activation MiB ({where})", f"{sp2['activations'] / MIB:.1f}",
            f"{one['activations'] / MIB:.1f} (1 process)", f"{long['activation_ratio']:.2f}x",
            f"<= {long['targets']['activation_ratio']}x",
        ),
        _row(
            "sequence parallel sp=2, rank 0 step peak MiB (same rows)", f"{sp2['step_peak'] / MIB:.1f}",
            f"{one['step_peak'] / MIB:.1f} (1 process)", f"{long['step_peak_ratio']:.2f}x",
        ),
        _row(
            "sequence parallel sp=2, trained tokens/s (same rows, 2 CPU processes over gloo)",
            f"{sp2['tokens_per_second']:.0f}", f"{one['tokens_per_second']:.0f} (1 process)",
            f"{long['tokens_per_second_ratio']:.2f}x",
        ),
        _row(
            "sequence parallel sp=2, longest row in 1 process's activation memory",
            f"{long['longest_row']['sp2']:,}", f"{long['longest_row']['one']:,} (1 process)",
            f"{long['longest_row']['sp2'] / long['longest_row']['one']:.2f}x",
        ),
    ]  # fmt: skip
    if "offloaded" not in median:  # a quick run's
        return rows
    offloaded, checkpointed = median["offloaded"], median["checkpointed"]
    return rows + [
        _row(
            "activation offload, device activation MiB (full checkpointing, 1 process)",
            f"{offloaded['activations'] / MIB:.1f}", f"{checkpointed['activations'] / MIB:.1f} (kept on device)",
            f"{long['offload_activation_ratio']:.2f}x",
        ),
        _row(
            "activation offload, trained tokens/s (same rows)", f"{offloaded['tokens_per_second']:.0f}",
            f"{checkpointed['tokens_per_second']:.0f} (kept on device)",
            f"{long['offload_tokens_per_second_ratio']:.2f}x",
        ),
    ]  # fmt: skip
