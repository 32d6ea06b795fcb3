"""trl_lora: target tokens/s of finetune LoRA vs TRL's SFTTrainer + PEFT (packing, padding-free), DDP"""

from __future__ import annotations

import json
import sys

from common import LORA, REPO, Bench, _free_port, _ratio, _row, _run, _steady_rate, _version


def measure(bench: Bench) -> dict:
    """finetune LoRA against TRL's SFTTrainer + PEFT (packing, padding-free): target tokens/s, both DDP
    on 2 processes, same model, data, targets and adapters."""
    size = bench.train_size
    model = bench.model(size)
    results: dict[str, list[float]] = {"finetune_lora_ddp": [], "trl_sft_lora_ddp": []}
    for repeat in range(bench.repeats):
        metrics = bench.finetune_run(f"lora-ddp-{repeat}", size, "ddp.yaml", **LORA)
        results["finetune_lora_ddp"].append(_steady_rate(metrics["target_tokens"], metrics["step_seconds"]))
        bench.curves.setdefault("finetune LoRA (DDP)", metrics["loss"])
        out = bench.work / "runs" / f"trl-{repeat}.json"
        _run([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(REPO / "bench" / "trl_sft.py"), str(model), str(bench.data), str(bench.steps),
            "8", "128", str(LORA["peft.r"]), str(out),
        ])  # fmt: skip
        trl = json.loads(out.read_text())
        results["trl_sft_lora_ddp"].append(_steady_rate(trl["target_tokens"], trl["step_seconds"]))
    ratio = _ratio(
        "target_tokens_per_second", "finetune_lora_ddp", results["finetune_lora_ddp"], "trl_sft_lora_ddp",
        results["trl_sft_lora_ddp"], target=1.1, size=size,
    )  # fmt: skip
    return ratio | {"trl_version": _version("trl")}


def rows(trl: dict) -> list[str]:
    return [
        _row(
            f"LoRA target tokens/s vs TRL SFTTrainer {trl['trl_version']} + PEFT ({trl['size']}, DDP)",
            f"{trl['median']['finetune_lora_ddp']:.0f}", f"{trl['median']['trl_sft_lora_ddp']:.0f}",
            f"{trl['ratio']:.2f}x", f">= {trl['target']}x",
        )
    ]  # fmt: skip
