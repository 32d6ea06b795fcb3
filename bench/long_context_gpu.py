"""The longest row one GPU trains, with and without activation offload, its tokens/s, and the plan's figure beside.

    python bench/long_context_gpu.py OUT.json [--quick] [--budget SECONDS]

For Llama-3.2-1B (every weight) and Llama-3.1-8B (LoRA r=16 on every linear layer), built from the configs
shipped with the recipes with random weights (nothing to download), as one GPU trains them (`single_gpu.yaml`):
float32 master weights (the 8B base in bf16 under LoRA), bf16 autocast, full activation checkpointing, the varlen
attention path, the chunked loss, the MLP in tiles of 8,192 tokens (`train.mlp_tile_tokens`), AdamW. One row of N
tokens (8 packed samples) per step; N doubles from 8,192 until a step runs out of memory, then one bisection
between the last two. Each length trains 2 steps and the second is timed. Beside each: `finetune plan`'s longest
`data.max_length` for the same launch (the case's recipe at micro-batch 1 with the same settings, `single_gpu.yaml`,
this GPU's memory), which the measurement checks. `--quick` runs a tiny Llama on CPU at 256 and 512 tokens (the
tests' dry run); `--budget` stops searching when the seconds are spent (what was measured is kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.config import PeftConfig  # noqa: E402
from finetune.engine import attention  # noqa: E402
from finetune.engine.recompute import checkpoint_kwargs, offload_layer_inputs, tile_mlps  # noqa: E402
from finetune.objectives.loss import batch_loss  # noqa: E402

CASES = {
    "llama-3.2-1b full": ("recipes/llama/configs/Llama-3.2-1B-Instruct/config.json", None),
    "llama-3.1-8b lora": ("recipes/llama/configs/Llama-3.1-8B-Instruct/config.json", PeftConfig(r=16, alpha=32)),
}
RECIPES = {
    "llama-3.2-1b full": "recipes/llama/llama-3.2-1b.yaml",
    "llama-3.1-8b lora": "recipes/llama/llama-3.1-8b-lora.yaml",
}
TILE = 8192


def build(config_file: str | None, peft: PeftConfig | None, device: torch.device, quick: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    attention.register()
    if quick:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    else:
        config = AutoConfig.from_pretrained(REPO / config_file, max_position_embeddings=2**21)
    config._attn_implementation = attention.NAME
    dtype = torch.bfloat16 if peft is not None else torch.float32  # an adapter run's base in bf16, as recipes do
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.NAME)
    if peft is not None:
        from finetune.model.adapters import add_adapters

        model = add_adapters(model, peft)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs("full"))
    model.train()
    return model


def row(length: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One packed row of 8 samples of length / 8 tokens, every token a target."""
    sample = length // 8
    ids = torch.randint(0, vocab, (1, length), device=device)
    positions = torch.arange(sample, device=device).repeat(8).reshape(1, length)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, sample - 1 :: sample] = -100
    cu = torch.arange(0, length + 1, sample, device=device, dtype=torch.int32)
    kept = (targets.reshape(-1) != -100).nonzero().reshape(-1)
    return {"input_ids": ids, "target_ids": targets, "position_ids": positions, "cu_seq_lens": cu, "kept_index": kept}


def try_length(model: torch.nn.Module, optimizer: torch.optim.Optimizer, length: int, device: torch.device) -> dict:
    """Two steps at `length`; the second timed. {"fits": False} on running out of memory."""
    vocab = model.get_input_embeddings().weight.shape[0]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    try:
        for _ in range(2):  # the second step is the one timed
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            began = time.perf_counter()
            with autocast:
                loss = batch_loss(model, row(length, vocab, device), "chunked").total / length
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"length": length, "fits": False}
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"length": length, "fits": True, "tokens_per_second": length / seconds, "peak_bytes": peak}


def search(case: str, offload: bool, device: torch.device, quick: bool, deadline: float) -> dict:
    config_file, peft = CASES[case]
    model = build(config_file, peft, device, quick)
    tile_mlps(model, 128 if quick else TILE)
    if offload:
        offload_layer_inputs(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")
    lengths = [256, 512] if quick else [8192 * 2**i for i in range(8)]
    tried = []
    for length in lengths:
        if time.perf_counter() > deadline:
            break
        tried.append(try_length(model, optimizer, length, device))
        if not tried[-1]["fits"]:
            fitting = [t["length"] for t in tried if t["fits"]]
            if fitting and time.perf_counter() < deadline:  # one bisection, to the nearest 4,096 tokens
                middle = (fitting[-1] + length) // 2 // 4096 * 4096
                if middle > fitting[-1]:
                    tried.append(try_length(model, optimizer, middle, device))
            break
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fits = [t for t in tried if t["fits"]]
    longest = max(fits, key=lambda t: t["length"]) if fits else None
    return {
        "case": case,
        "offload": offload,
        "tried": tried,
        "longest": longest,
        "planned": planned(case, offload, device),
    }


def planned(case: str, offload: bool, device: torch.device) -> int:
    """`finetune plan`'s longest `data.max_length` for this case on this GPU (on CPU, for an 80 GB one)."""
    from finetune.config import load_recipe
    from finetune.engine.launch import read_launch
    from finetune.plan.shape import model_shape, planned_model
    from finetune.plan.verdict import longest_fitting_length

    settings = ["train.micro_batch_size=1", "train.global_batch_size=null", "train.activation_checkpointing=full",
                f"train.activation_offload={str(offload).lower()}", f"train.mlp_tile_tokens={TILE}",
                "model.attn_implementation=varlen"]  # fmt: skip
    recipe = load_recipe(REPO / RECIPES[case], settings)
    launch = read_launch(REPO / "accelerate_configs" / "single_gpu.yaml", 1, 1)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * 10**9
    return longest_fitting_length(model_shape(planned_model(recipe)), recipe, launch, memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true", help="a tiny model on CPU (the tests' dry run)")
    parser.add_argument("--budget", type=float, default=600, help="seconds to spend searching")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    deadline = time.perf_counter() + args.budget
    results = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "runs": [search(case, offload, device, args.quick, deadline) for case in CASES for offload in (False, True)],
    }
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    for run in results["runs"]:
        longest = run["longest"]
        fit = f"{longest['length']:,} tokens, {longest['tokens_per_second']:.0f} tokens/s" if longest else "none"
        print(f"{run['case']}{', offload' if run['offload'] else ''}: longest row {fit}; planned {run['planned']:,}")


if __name__ == "__main__":
    main()
