"""Digests of what short demo runs leave behind, to show that a change of structure changes no number.

    python bench/same_outputs.py OUT.json [--compare BEFORE.json]

Runs full fine-tuning, LoRA, DPO, a mixture of experts (Qwen3-MoE with its balancing loss), online RL (GRPO, the
demo's exact-reversal reward; with a KL penalty to a frozen copy or to the adapters switched off), LoRA DPO and
distillation (half the steps on-policy) for 6 steps each on 2 CPU processes under FSDP2 (the demo's model,
tokenizer and data, built offline), and writes, per run, the sha256 of `final_logits.safetensors`, of every
exported tensor, and the logged losses exactly as `metrics.jsonl` has them. Run it before and after a refactor on
the same machine and torch: `--compare` lists every digest that moved (and exits 1), or says that all are
bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
STEPS = {"train.max_steps": 6, "train.eval_every_steps": 3, "train.log_every_steps": 1, "optim.warmup_steps": 2,
         "train.global_batch_size": "null"}  # fmt: skip
LORA = {"peft.r": 8, "peft.target_modules": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"}
DPO = {"data.train_path": "{data}/pairs_train.jsonl", "data.eval_path": "{data}/pairs_eval.jsonl",
       "data.format": "auto", "preference.loss": "dpo", "preference.beta": 0.1,
       "train.micro_batch_size": 4}  # fmt: skip
GRPO = {"recipe": "tiny_llama_grpo.yaml", "data.train_path": "{data}/prompts_train.jsonl",
        "data.eval_path": "{data}/prompts_eval.jsonl", "eval.generate.samples": 16,
        "train.micro_batch_size": 2,
        # a reward the demo's random base earns on some completions and not others, so that every step trains
        "rl.rewards": "[{{function: regex, pattern: '.*7.*'}}]"}  # fmt: skip
DISTILL = {"recipe": "tiny_llama_distill.yaml", "model.name_or_path": "{assets}/student",
           "distill.teacher": "{assets}/base"}  # fmt: skip
RUNS = {
    "full": {}, "lora": LORA, "dpo": DPO, "moe": {"model.name_or_path": "{moe}", "train.micro_batch_size": 4},
    "grpo": GRPO, "distill": DISTILL,
    # The references the weights seam gives: a frozen copy of the initial weights, or the adapters switched off.
    "grpo_kl": {**GRPO, "rl.beta": 0.04}, "grpo_lora_kl": {**GRPO, **LORA, "rl.beta": 0.04},
    "dpo_lora": {**DPO, **LORA},
}  # fmt: skip


def moe_base(assets: Path) -> Path:
    """A tiny Qwen3-MoE (top 2 of 4 experts) with the demo's tokenizer, saved as a hub model is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets / "base")
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256,
    )  # fmt: skip
    folder = assets / "moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def launch(name: str, settings: dict, assets: Path, moe: Path, out: Path) -> Path:
    settings = dict(settings)
    recipe = settings.pop("recipe", "tiny_llama.yaml")
    values = {
        "model.name_or_path": assets / "base", "data.train_path": assets / "data" / "train.jsonl",
        "data.eval_path": assets / "data" / "eval.jsonl", "output.dir": out / name, "output.trackers": "[]", **STEPS,
        **{key: str(value).format(assets=assets, data=assets / "data", moe=moe) for key, value in settings.items()},
    }  # fmt: skip
    wrap = ["--fsdp_transformer_layer_cls_to_wrap", "Qwen3MoeDecoderLayer"] if name == "moe" else []
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "accelerate_configs" / "fsdp2_full_shard.yaml"), "--num_processes", "2", "--mixed_precision", "no",
        *wrap, "-m", "finetune", "train", str(REPO / "recipes" / "demo" / recipe),
        *(f"{key}={value}" for key, value in values.items()),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{name} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return out / name


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(run: Path) -> dict[str, object]:
    exported = {}
    for file in sorted((run / "final").rglob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in sorted(f.keys()):  # noqa: SIM118
                tensor = f.get_tensor(key)
                exported[f"{file.name}:{key}"] = sha256(tensor.numpy().tobytes()) + f":{tensor.dtype}"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "final_logits": sha256((run / "final_logits.safetensors").read_bytes()),
        "exported": exported,
        "losses": [[m["step"], m["loss"]] for m in metrics if "loss" in m],
        "eval_losses": [[m["step"], m["eval_loss"]] for m in metrics if "eval_loss" in m],
    }


def main() -> None:
    out_file = Path(sys.argv[1])
    before = Path(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--compare" else None
    with tempfile.TemporaryDirectory() as tmp:
        assets = Path(tmp) / "demo"
        subprocess.run([sys.executable, "-m", "finetune", "demo", "build", "--dir", str(assets)], check=True, cwd=REPO,
                       capture_output=True)  # fmt: skip
        moe = moe_base(assets)
        result = {name: digests(launch(name, settings, assets, moe, Path(tmp))) for name, settings in RUNS.items()}
    out_file.write_text(json.dumps(result, indent=1, sort_keys=True))
    if before is None:
        counts = ", ".join(f"{name} ({len(run['exported'])} tensors)" for name, run in result.items())
        print(f"wrote {out_file}: {counts}")
        return
    old = json.loads(before.read_text())
    moved = [f"{name}.{key}" for name in RUNS for key, value in result[name].items() if value != old[name].get(key)]
    if moved:
        sys.exit(f"changed against {before}: {', '.join(moved)}")
    print(f"bit-identical to {before}: final logits, exported tensors and losses of {', '.join(RUNS)}")


if __name__ == "__main__":
    main()
