"""moe: a mixture of experts (Qwen3-MoE, top 2 of 8), grouped_mm experts vs the per-expert loop and vs TRL, DDP"""

from __future__ import annotations

import json
import sys

from common import REPO, Bench, _free_port, _ratio, _row, _run, _steady_rate, _version


def measure(bench: Bench) -> dict:
    """A mixture of experts (Qwen3-MoE, 8 experts, top 2) trained in full, DDP on 2 processes, with the routers'
    balancing loss on: target tokens/s with transformers' grouped_mm experts against its per-expert loop
    (`eager`), and against TRL's SFTTrainer, whose model adds its own balancing loss (output_router_logits)."""
    size = bench.train_size
    model = bench.model(size, experts=8)
    runs: dict[str, list[float]] = {"grouped_mm": [], "eager": [], "trl_sft_moe_ddp": []}
    for repeat in range(bench.repeats):
        for experts in ("grouped_mm", "eager"):
            overrides = {"model.name_or_path": model, "model.experts_implementation": experts}
            metrics = bench.finetune_run(f"moe-{experts}-{repeat}", size, "ddp.yaml", **overrides)
            runs[experts].append(_steady_rate(metrics["target_tokens"], metrics["step_seconds"]))
            if experts == "grouped_mm":
                bench.curves.setdefault("finetune MoE (DDP)", metrics["loss"])
        out = bench.work / "runs" / f"trl-moe-{repeat}.json"
        _run([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(REPO / "bench" / "trl_sft.py"), str(model), str(bench.data), str(bench.steps),
            "8", "128", "0", str(out), "router_aux",
        ])  # fmt: skip
        trl = json.loads(out.read_text())
        runs["trl_sft_moe_ddp"].append(_steady_rate(trl["target_tokens"], trl["step_seconds"]))
    metric = "target_tokens_per_second"
    return {
        "experts": _ratio(metric, "grouped_mm", runs["grouped_mm"], "eager", runs["eager"], target=1.0, size=size),
        "trl": _ratio(
            metric,
            "grouped_mm",
            runs["grouped_mm"],
            "trl_sft_moe_ddp",
            runs["trl_sft_moe_ddp"],
            target=1.1,
            size=size,
        ),
        "trl_version": _version("trl"),
    }


def rows(moe: dict) -> list[str]:
    experts, trl = moe["experts"], moe["trl"]
    return [
        _row(
            f"MoE target tokens/s, grouped_mm vs per-expert loop ({experts['size']}, 8 experts top 2, DDP)",
            f"{experts['median']['grouped_mm']:.0f}", f"{experts['median']['eager']:.0f}", f"{experts['ratio']:.2f}x",
            f">= {experts['target']}x",
        ),
        _row(
            f"MoE target tokens/s vs TRL SFTTrainer {moe['trl_version']}, balancing loss on in both (DDP)",
            f"{trl['median']['grouped_mm']:.0f}", f"{trl['median']['trl_sft_moe_ddp']:.0f}", f"{trl['ratio']:.2f}x",
            f">= {trl['target']}x",
        ),
    ]  # fmt: skip
