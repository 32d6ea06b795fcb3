"""trainer: target tokens/s of finetune (DDP and FSDP2) vs transformers.Trainer and TRL SFTTrainer (DDP)"""

from __future__ import annotations

import json
import statistics
import sys

from common import REPO, Bench, _free_port, _row, _run, _steady_rate, _version


def measure(bench: Bench) -> dict:
    """Target tokens/s on variable-length chat samples: finetune (packed) vs Trainer (padded) and vs
    TRL's SFTTrainer (packed, padding-free; bench/trl_sft.py with every weight trained)."""
    size = bench.train_size
    model = bench.model(size)
    results: dict[str, list[float]] = {
        "finetune_ddp": [],
        "finetune_fsdp2": [],
        "trainer_ddp": [],
        "trl_sft_ddp": [],
    }
    for repeat in range(bench.repeats):
        for name, config in (("finetune_ddp", "ddp.yaml"), ("finetune_fsdp2", "fsdp2_full_shard.yaml")):
            metrics = bench.finetune_run(f"{name}-{repeat}", size, config)
            results[name].append(_steady_rate(metrics["target_tokens"], metrics["step_seconds"]))
        out = bench.work / "runs" / f"trainer-{repeat}.json"
        _run([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(REPO / "bench" / "trainer_ddp.py"), str(model), str(bench.data),
            str(bench.steps), "8", str(out),
        ])  # fmt: skip
        trainer = json.loads(out.read_text())
        results["trainer_ddp"].append(_steady_rate(trainer["target_tokens"], trainer["step_seconds"]))
        out = bench.work / "runs" / f"trl-full-{repeat}.json"
        _run([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(REPO / "bench" / "trl_sft.py"), str(model), str(bench.data), str(bench.steps),
            "8", "128", "0", str(out),
        ])  # fmt: skip
        trl = json.loads(out.read_text())
        results["trl_sft_ddp"].append(_steady_rate(trl["target_tokens"], trl["step_seconds"]))
    medians = {name: statistics.median(values) for name, values in results.items()}
    return {
        "metric": "target_tokens_per_second",
        "size": size.name,
        "runs": results,
        "median": medians,
        "ratio_ddp": medians["finetune_ddp"] / medians["trainer_ddp"],
        "ratio_fsdp2": medians["finetune_fsdp2"] / medians["trainer_ddp"],
        "target": 1.3,
        "ratio_trl_ddp": medians["finetune_ddp"] / medians["trl_sft_ddp"],
        "trl_version": _version("trl"),
        "target_trl": 1.1,
    }


def rows(trainer: dict) -> list[str]:
    median, size = trainer["median"], trainer["size"]
    return [
        _row(
            f"target tokens/s vs Trainer DDP ({size})",
            f"DDP {median['finetune_ddp']:.0f}, FSDP2 {median['finetune_fsdp2']:.0f}", f"{median['trainer_ddp']:.0f}",
            f"DDP {trainer['ratio_ddp']:.2f}x, FSDP2 {trainer['ratio_fsdp2']:.2f}x", f">= {trainer['target']}x",
        ),
        _row(
            f"target tokens/s vs TRL SFTTrainer {trainer['trl_version']} (packing, padding-free; {size}, DDP)",
            f"{median['finetune_ddp']:.0f}", f"{median['trl_sft_ddp']:.0f}", f"{trainer['ratio_trl_ddp']:.2f}x",
            f">= {trainer['target_trl']}x",
        ),
    ]  # fmt: skip
