"""`make bench-gpu`: finetune on the GPUs of this machine, Llama-3.2-1B shape, bf16, sequence 2048.

    python bench/gpu.py [--quick] [--steps 30] [--micro-batch 4 [8 ...]] [--only TEXT ...] [--variant NAME ...]
                        [--profile FIRST,LAST]

The model has Llama-3.2-1B's architecture (recipes/llama/configs/Llama-3.2-1B-Instruct/config.json)
and random weights, so nothing is downloaded; the data is synthetic texts of varied length, packed
several to a row of 2048 tokens. Each variant is one `accelerate launch` of `finetune train` on every
visible GPU, bf16 compute over float32 master weights: on one GPU with accelerate_configs/single_gpu.yaml (a
plain module, no FSDP machinery), on several with the single-node preset (FSDP2 full shard); one lever
changed at a time (VARIANTS): the loss path, the attention path, the activation-checkpointing
policy, regional compilation; then varlen with compile, and with liger-kernel's fused kernels (model.kernels)
instead; each at every micro-batch given.
Reported per GPU: tokens/s, MFU (finetune.plan.flops: 6 N per token + 6 L d_attn n^2 per sample of n tokens,
over the device's dense bf16 peak), the rows' fill and the step-1 peak memory. Results:
bench/results/<date>-<commit>-gpu.json and .md, rewritten after every launch (a run stopped at a time
limit keeps the rows it finished), whose table is what docs/benchmarks.md quotes. `--quick` runs a tiny
model on 2 CPU processes (what the tests run).
`--profile 10,12` also records those steps of every variant with the torch profiler
(`train.profile_steps`): rank 0's operator table lands beside the results as
<stem>-profile-<variant>.txt, its trace stays under --work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from common import CONFIGS, ENV, RECIPE, REPO, _free_port, _git, _steady

SHAPE = REPO / "recipes" / "llama" / "configs" / "Llama-3.2-1B-Instruct" / "config.json"
# The recipe sets checkpointing (train.activation_checkpointing), so an FSDP preset's own is turned off.
NO_FSDP_AC = ["--fsdp_activation_checkpointing", "false"]
ENGINES = {"single_gpu.yaml": "one GPU, no FSDP"}
COMPILE = ["--dynamo_backend", "inductor", "--dynamo_use_regional_compilation"]
VARLEN = {"model.attn_implementation": "varlen"}
# One lever at a time against "chunked loss, no checkpointing" (the defaults), then all the levers that pay
# together: name -> (launch flags, recipe overrides).
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "full logits, no checkpointing": ([], {"train.loss_path": "full_logits"}),
    "chunked loss, no checkpointing": ([], {}),
    "chunked loss, varlen attention": ([], VARLEN),
    "chunked loss, selective checkpointing": ([], {"train.activation_checkpointing": "selective"}),
    "chunked loss, full checkpointing": ([], {"train.activation_checkpointing": "full"}),
    "chunked loss, regional compile": (COMPILE, {}),
    "chunked loss, varlen attention, regional compile": (COMPILE, VARLEN),
    # RMSNorm, SwiGLU and rotary embeddings in liger-kernel's Triton kernels instead (model.kernels).
    "chunked loss, varlen attention, liger kernels": ([], {**VARLEN, "model.kernels": "liger"}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on 2 CPU processes (the tests' run)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[4], help="rows per GPU; several: each")
    parser.add_argument("--only", action="append", help="run the variants whose name contains this (repeatable)")
    parser.add_argument("--variant", action="append", help="run the variant of exactly this name (repeatable)")
    parser.add_argument("--work", default=str(REPO / "outputs" / "bench-gpu"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "--config", help="accelerate config (default: single_gpu.yaml on one GPU, else single_node.yaml)"
    )
    parser.add_argument("--profile", help="FIRST,LAST: steps to record with the torch profiler (train.profile_steps)")
    args = parser.parse_args()
    import torch

    if not args.quick and not torch.cuda.is_available():
        raise SystemExit("bench-gpu: no CUDA GPU visible; run it on a GPU machine (or --quick on CPU)")
    work = Path(args.work)
    seq = 128 if args.quick else 2048
    model = build_model(work, quick=args.quick)
    data = build_data(work, seq)
    gpus = 2 if args.quick else torch.cuda.device_count()
    device = "CPU (quick)" if args.quick else f"{gpus} x {torch.cuda.get_device_name(0)}"
    config = args.config or ("single_gpu.yaml" if gpus == 1 else "single_node.yaml")
    variants = {name: lever for name, lever in VARIANTS.items() if chosen(name, args)}
    if not variants:
        raise SystemExit(f"bench-gpu: no variant matches; they are: {', '.join(VARIANTS)}")
    rows = []
    for micro_batch in args.micro_batch:
        for name, (launch_args, recipe) in variants.items():
            print(f"bench-gpu: {name}, micro-batch {micro_batch} ...", flush=True)
            rows.append(measure(name, config, launch_args, recipe, model, data, work, seq, gpus, micro_batch, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
            table = write_results(rows, device, config, seq, torch.__version__, args)
    print(table, flush=True)


def chosen(name: str, args) -> bool:
    """Compilation and liger's Triton kernels are left out of --quick (CPU); --variant names exactly, --only by a
    part of the name."""
    if args.quick and ("compile" in name or "liger" in name):
        return False
    if args.variant or args.only:
        return name in (args.variant or []) or any(part in name for part in args.only or [])
    return True


def write_results(rows: list[dict], device: str, config: str, seq: int, torch_version: str, args) -> str:
    """The results so far, as JSON and Markdown (and each profiled row's operator table); returns the table."""
    results = {
        "date": __import__("datetime").date.today().isoformat(),
        "commit": os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "device": device,
        "torch": torch_version,
        "shape": str(SHAPE.relative_to(REPO)) if not args.quick else "tiny",
        "compute": "float32 (CPU)" if args.quick else "bf16",
        "sequence_length": seq,
        "micro_batch": args.micro_batch,  # each row says its own
        "engine": ENGINES.get(config, "FSDP2 full shard") + f" ({config})",
        "mfu_formula": "6 N per token + 6 L d_attn n^2 per sample of n tokens (finetune/plan/flops.py); "
        "peak: dense bf16",
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{results['date']}-{results['commit']}-gpu{'-quick' if args.quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(results))
    for row in rows:
        if "profile" in row:
            Path(f"{stem}-profile-{_slug(row['variant'])}-mb{row['micro_batch']}.txt").write_text(row["profile"])
    return markdown(results)


def build_model(work: Path, quick: bool) -> Path:
    """Random weights in the target shape, saved once with the demo tokenizer (its ids fit any vocab)."""
    folder = work / ("tiny-model" if quick else "llama-3.2-1b-shape")
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.run import demo

    demo.build(str(work / "demo"))
    tokenizer = AutoTokenizer.from_pretrained(work / "demo" / "base")
    if quick:
        config = AutoConfig.from_pretrained(work / "demo" / "base")
    else:
        config = AutoConfig.from_pretrained(SHAPE)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    # Initialized on the GPU where there is one: 1.2B parameters take a CPU about a minute of a short GPU lease.
    with torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_suffix(".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def build_data(work: Path, seq: int) -> Path:
    """Synthetic texts of varied length (from a few dozen words to a row's worth), packed several to a
    row as fine-tuning data is: what makes the attention path matter."""
    path = work / f"text-{seq}.jsonl"
    if not path.exists():
        rng = random.Random(0)
        words = ["".join(rng.choice("abcdefghij0123456789") for _ in range(rng.randint(2, 6))) for _ in range(500)]
        lengths = [int(seq * rng.uniform(0.02, 0.4)) for _ in range(2048)]
        lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) for n in lengths]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return path


def measure(
    name: str, config: str, launch_args: list[str], recipe: dict[str, str], model: Path, data: Path, work: Path,
    seq: int, gpus: int, micro_batch: int, args,
) -> dict:  # fmt: skip
    out = work / "runs" / f"{_slug(name)}-mb{micro_batch}"
    overrides = {
        "model.name_or_path": model,
        "data.train_path": data,
        "data.eval_path": "null",
        "eval.generate": "null",  # the demo recipe's evaluation by generation needs eval data
        "data.format": "text",
        "data.max_length": seq,
        "train.micro_batch_size": micro_batch,
        "train.global_batch_size": "null",  # one micro-batch a step, whatever the recipe's global batch
        "train.max_steps": 6 if args.quick else args.steps,
        "train.log_every_steps": 1,
        "train.eval_every_steps": 0,
        "optim.warmup_steps": 0,
        "output.dir": out,
        "output.overwrite": "true",
        "output.trackers": "[]",
        "output.export": "false",
        **({"train.profile_steps": f"[{args.profile}]"} if args.profile else {}),
        **recipe,
    }
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
        "--num_processes", str(gpus), "--num_machines", "1", "--main_process_port", str(_free_port()),
        "--mixed_precision", "no" if args.quick else "bf16", *(NO_FSDP_AC if config != "single_gpu.yaml" else []),
        *launch_args,
        "-m", "finetune", "train", str(RECIPE), *[f"{k}={v}" for k, v in overrides.items()],
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        print("\n".join(result.stderr.strip().splitlines()[-40:]), file=sys.stderr, flush=True)
        error = (result.stderr.strip().splitlines() or ["failed"])[-1][:300]
        return {"variant": name, "micro_batch": micro_batch, "error": error}
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The profiled steps (--profile) are timed under the profiler: left out of the rates, kept in the losses.
    first, last = map(int, args.profile.split(",")) if args.profile else (0, -1)
    logged = [e for e in entries if "loss" in e]
    steps = [e for e in logged if not first <= e["step"] <= last]
    memory = next(e for e in entries if "memory/rank0/step_peak" in e)
    mfu = [e["mfu"] for e in steps if "mfu" in e]
    return {
        "variant": name,
        "micro_batch": micro_batch,
        "tokens_per_second_per_gpu": statistics.median(_steady([e["tokens_per_second"] for e in steps])) / gpus,
        "mfu": statistics.median(_steady(mfu)) if mfu else None,
        "step_seconds": statistics.median(_steady([e["step_seconds"] for e in steps])),
        "fill": statistics.median(e["fill"] for e in steps),
        "peak_memory_bytes": memory["memory/rank0/step_peak"],
        "loss_first_last": [logged[0]["loss"], logged[-1]["loss"]],
        **({"profile": (out / "profile" / "rank0.txt").read_text()} if args.profile else {}),
    }


def _slug(variant: str) -> str:
    return variant.replace(" ", "-").replace(",", "")


def markdown(results: dict) -> str:
    lines = [
        f"GPU benchmark {results['date']} ({results['commit']}), {results['device']}, torch {results['torch']}: "
        f"{results['shape']}, {results['compute']} compute, sequence {results['sequence_length']}, "
        f"{results.get('engine', 'FSDP2 full shard (single_node.yaml)')}.",
        "",
        "| variant | micro-batch per GPU | tokens/s per GPU | MFU | fill | step s | peak memory GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['micro_batch']} | failed: {row['error']} | | | | |")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a (peak unknown)"
        lines.append(
            f"| {row['variant']} | {row['micro_batch']} | {row['tokens_per_second_per_gpu']:.0f} | {mfu} | "
            f"{row['fill']:.3f} | {row['step_seconds']:.3f} | {row['peak_memory_bytes'] / 2**30:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
