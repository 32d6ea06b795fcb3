"""Rollout decoding on one GPU: tokens/s of each way `finetune.rollouts.generation.complete` decodes, against the
memory-bandwidth bound.

    python bench/decode_gpu.py [--quick] [--prompts 8] [--group 8] [--prompt-tokens 148] [--new-tokens 512]
                               [--way NAME ...] [--out DIR]

Llama-3.2-1B's shape (recipes/llama/configs/Llama-3.2-1B-Instruct/config.json), random weights in bf16,
`prompts` x `group` completions (64 rows by default: online RL's group of 8 for 8 prompts) of `new-tokens`
tokens each, sampled with seeded noise at temperature 1, with no stop token: every row decodes to the end, so
this measures decoding alone (rows leaving early is what the CPU bench and tests cover). The ways (WAYS):
transformers' `generate` (what rollouts ran before finetune's loop), the dynamic loop (`rl.rollout_cache:
dynamic`), the static cache with an eager step, and with its step compiled in reduce-overhead mode (CUDA graphs:
`rl.rollout_cache: static` on one GPU). Each way's rollout is timed after an untimed one: a whole rollout for
the compiled way (compilation and graph capture), 8 tokens for the others (kernels and allocator warmed). The
static ways must write the dynamic loop's tokens (the tokens are compared; bf16 rounding may flip a near-tie, so
the share equal is reported).

The bound: each decoding step must read every weight once and each row's keys and values so far, so the fastest
a step can be is those bytes over the GPU's memory bandwidth (BANDWIDTH, the vendors' figures); the fraction is
that over the measured time. Results: <out>/<date>-<commit>-decode.json and .md. `--quick` runs the demo's tiny
model on the CPU, the ways that need no GPU (what the tests run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import types
from pathlib import Path

from common import REPO, _git

SHAPE = REPO / "recipes" / "llama" / "configs" / "Llama-3.2-1B-Instruct" / "config.json"
WAYS = ["dynamic", "generate", "static", "static compiled"]  # dynamic first: the others' tokens are compared to its
# Peak memory bandwidth, bytes/s (NVIDIA's data sheets), by a part of the device's name.
BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the demo's tiny model on CPU (the tests' run)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=148)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--way", action="append", choices=WAYS, help="run this way only (repeatable)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    import torch

    if not args.quick and not torch.cuda.is_available():
        raise SystemExit("decode_gpu: no CUDA GPU visible; run it on a GPU machine (or --quick on CPU)")
    if args.quick:
        args.prompts, args.group, args.prompt_tokens, args.new_tokens = 2, 4, 12, 16
    device = torch.device("cpu" if args.quick else "cuda")
    model = build_model(args.quick, device)
    ways = [w for w in args.way or WAYS if not (args.quick and w == "static compiled")]  # CUDA graphs: a GPU's
    rows, reference = [], None
    for way in ways:
        try:
            row, tokens = measure(model, way, args, device)
        except Exception as exc:  # one way failing (a compilation, say) leaves the others' figures standing
            rows.append({"way": way, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if way == "dynamic":
            reference = tokens
        row["same_tokens_as_dynamic"] = None if reference is None else _same_share(tokens, reference)
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = "CPU (quick)" if args.quick else torch.cuda.get_device_name(0)
    write_results(rows, name, args, torch.__version__)


def build_model(quick: bool, device):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if quick:
        config = LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4)  # fmt: skip
    else:
        config = AutoConfig.from_pretrained(SHAPE)
    config.eos_token_id = None  # no stop token: every row decodes to the end
    torch.manual_seed(0)
    with device:  # 1.2B parameters initialized on the GPU: seconds instead of a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if quick else torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def measure(model, way: str, args, device) -> tuple[dict, list[list[int]]]:
    """One way, twice: the second run's tokens/s (every row's new tokens over the wall time)."""
    import torch

    from finetune.rollouts.generation import Sampling, complete, generating, row_noise
    from finetune.rollouts.static_decode import StaticDecoding

    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (args.prompt_tokens,), generator=generator) for _ in range(args.prompts)]
    prompts = [p.tolist() for p in prompts]
    rows = [p for p in prompts for _ in range(args.group)]
    sampling = Sampling(1.0, 1.0, row_noise([(n,) for n in range(len(rows))], args.new_tokens))
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=None)
    accelerator = types.SimpleNamespace(device=device, num_processes=1)
    static = {"static": StaticDecoding(None), "static compiled": StaticDecoding({"mode": "reduce-overhead"})}.get(way)
    seconds = []

    def run(new_tokens: int) -> list[list[int]]:
        _synchronize(device)
        began = time.perf_counter()
        tokens = complete(model, rows, tokenizer, accelerator, new_tokens, sampling, group=args.group,
                          reference=way == "generate", static=static)  # fmt: skip
        _synchronize(device)
        seconds.append(time.perf_counter() - began)
        return tokens

    with torch.no_grad(), generating(model):
        # The compiled way's first rollout compiles and captures its shape: a whole one, untimed. The others warm
        # their kernels and allocator on a few tokens (a second whole rollout each would not fit the check's cap).
        run(args.new_tokens if way == "static compiled" else 8)
        tokens = run(args.new_tokens)
    written = sum(len(t) for t in tokens)
    row = {"way": way, "rows": len(rows), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
           "tokens_written": written, "first_seconds": seconds[0], "seconds": seconds[1],
           "tokens_per_second": written / seconds[1]}  # fmt: skip
    bound = bound_seconds(model, len(rows), args.prompt_tokens, args.new_tokens, device)
    row["bandwidth_bound_fraction"] = None if bound is None else bound / seconds[1]
    return row, tokens


def bound_seconds(model, rows: int, prompt: int, new: int, device) -> float | None:
    """The least time `new` decoding steps can take: every weight and each row's cache so far read once a step."""
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    bandwidth = next((value for part, value in BANDWIDTH.items() if part in name), None)
    if bandwidth is None:
        return None
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # keys and values, bf16
    cached = sum(prompt + t for t in range(new))  # tokens in each row's cache at each step
    return (new * weights + rows * per_token * cached) / bandwidth


def _same_share(tokens: list[list[int]], reference: list[list[int]]) -> float:
    same = sum(a == b for row, other in zip(tokens, reference, strict=True) for a, b in zip(row, other, strict=True))
    return same / max(sum(len(row) for row in reference), 1)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def write_results(rows: list[dict], device: str, args, torch_version: str) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{datetime.date.today().isoformat()}-{_git('rev-parse', '--short', 'HEAD')}-decode"
    meta = {"device": device, "torch": torch_version, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    measured = [r for r in rows if "error" not in r]
    baseline = next((r["tokens_per_second"] for r in measured if r["way"] == "dynamic"), None)
    before = next((r["tokens_per_second"] for r in measured if r["way"] == "generate"), None)
    shape = measured[0] if measured else {"rows": "?", "prompt_tokens": "?", "new_tokens": "?"}
    lines = [
        f"Rollout decoding on {device} (torch {torch_version}): {shape['rows']} rows, "
        f"{shape['prompt_tokens']}-token prompts, {shape['new_tokens']} new tokens each, no stop token "
        "(`python bench/decode_gpu.py`).",
        "",
        "| way | tokens/s | x generate | x dynamic loop | of the bandwidth bound | untimed first run, s | "
        "same tokens as dynamic |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['way']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['tokens_per_second'] / baseline:.2f}x" if baseline else "n/a"
        over = f"{r['tokens_per_second'] / before:.2f}x" if before else "n/a"
        fraction = f"{100 * r['bandwidth_bound_fraction']:.1f}%" if r["bandwidth_bound_fraction"] else "n/a"
        same = f"{100 * r['same_tokens_as_dynamic']:.1f}%" if r["same_tokens_as_dynamic"] is not None else "n/a"
        lines.append(f"| {r['way']} | {r['tokens_per_second']:.0f} | {over} | {ratio} | {fraction} | "
                     f"{r['first_seconds']:.1f} | {same} |")  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
