"""grpo: online RL prompts/s through whole steps (generation included) and peak RSS vs TRL GRPOTrainer"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from common import MIB, REPO, Bench, _free_port, _medians, _row, _steady_median, _timed_peak_rss, _version

GRPO_RECIPE = REPO / "recipes" / "demo" / "tiny_llama_grpo.yaml"


# Prefixed to every demo prompt in the second shape: what a real RL prompt carries besides its question (a
# system prompt, the task's instructions, the answer's format), about 150 tokens with the demo's tokenizer.
INSTRUCTION = (
    "You answer list puzzles. Read the numbers after the colon and write them in the opposite order, separated by "
    "single spaces, with nothing else. "
)


def measure(bench: Bench) -> dict:
    """GRPO against TRL's GRPOTrainer (bench/trl_grpo.py), 2 processes, the same randomly initialised model, demo
    prompts, exact-reversal reward, 8 completions a prompt, the same number of new tokens, temperature 1, DAPO's
    loss, beta 0, one update per rollout, fp32 both: prompts per second through whole steps (sampling, scoring,
    the forward and backward, the update) and the peak resident memory of the largest process, and the mean length
    of the completions each side drew: each repetition seeds both sides anew (a randomly initialised model's
    lengths vary widely from draw to draw at hundreds of new tokens; at 32 nearly every completion runs to the
    limit), and the lengths compared are the means over all repetitions. finetune under
    DDP (TRL's engine) and FSDP2. Two prompt shapes: the demo's bare lists (about 10 tokens, shorter than any real
    RL prompt) and the same lists after an instruction (about 150 tokens, as a math prompt's question and
    instructions in a chat template); and at the lengths RL runs (the instructed prompts with up to 256 and 512 new
    tokens), where both sides also run with gradient checkpointing (TRL's default) and TRL's faster setting is the
    one compared with. Quick runs the instructed shape at 8 tokens only."""
    size = bench.train_size
    model = bench.model(size)
    bare = bench.work / "demo" / "data" / "prompts_train.jsonl"
    instructed = _instructed(bare, bench.work / "grpo_prompts_instructed.jsonl")
    # name: (prompts, prompts per process, generations, new tokens, steps, checkpointing compared)
    shapes = {
        "bare": (bare, 4, 8, 32, 8, False), "instructed": (instructed, 4, 8, 32, 8, False),
        "instructed-256": (instructed, 2, 8, 256, 4, True), "instructed-512": (instructed, 2, 8, 512, 4, True),
    }  # fmt: skip
    if bench.quick:
        shapes = {"instructed": (instructed, 2, 4, 8, 3, False)}
    results = {shape: _compare(bench, model, f"{shape}-", *settings) for shape, settings in shapes.items()}
    generations, new_tokens = shapes["instructed"][2], shapes["instructed"][3]
    return {
        "size": size.name, "shapes": results, "targets": {"prompts_per_second": 1.5, "peak_rss": 1.0},
        "layouts": _row_layouts(model, generations, new_tokens, bench.repeats), "trl_version": _version("trl"),
    }  # fmt: skip


def _instructed(bare: Path, path: Path) -> Path:
    """The demo prompts with `INSTRUCTION` before each list."""
    with path.open("w") as out:
        for line in bare.read_text().splitlines():
            sample = json.loads(line)
            sample["prompt"][-1]["content"] = INSTRUCTION + sample["prompt"][-1]["content"]
            out.write(json.dumps(sample) + "\n")
    return path


def _compare(
    bench: Bench, model: Path, tag: str, prompts_file: Path, prompts: int, generations: int, new_tokens: int,
    steps: int, checkpointing: bool,
) -> dict:  # fmt: skip
    """The contenders' medians over `bench.repeats` interleaved repetitions on one prompt file (repetition k seeded
    k on both sides), their mean completion lengths, and their ratios to TRL's (with `checkpointing`, its faster of
    gradient checkpointing on and off, and finetune's with it too)."""
    settings = {
        "data.train_path": prompts_file, "data.max_length": 256 + new_tokens, "data.packing": "false",
        "data.format": "auto", "rl.num_generations": generations, "rl.max_new_tokens": new_tokens,
        "rl.temperature": 1.0, "rl.loss": "dapo", "rl.beta": 0.0, "train.micro_batch_size": prompts,
        "train.max_steps": steps,
    }  # fmt: skip
    contenders = {"finetune_ddp": ("ddp.yaml", False), "finetune_fsdp2": ("fsdp2_full_shard.yaml", False)}
    peers = {"trl": False}
    if checkpointing:
        contenders = {
            "finetune_fsdp2": ("fsdp2_full_shard.yaml", False), "finetune_fsdp2_ac": ("fsdp2_full_shard.yaml", True),
        }  # fmt: skip
        peers = {"trl_no_gc": False, "trl_gc": True}
    runs: dict[str, list[dict]] = {name: [] for name in [*contenders, *peers]}
    (bench.work / "runs").mkdir(parents=True, exist_ok=True)
    for repeat in range(bench.repeats):
        for name, (config, recompute) in contenders.items():
            run = f"grpo-{tag}{name}-{repeat}"
            command, out = bench.finetune_command(
                run, bench.train_size, config, recipe=GRPO_RECIPE, **settings,
                **{"train.activation_checkpointing": "full" if recompute else "none", "train.seed": repeat},
            )  # fmt: skip
            _, peak = _timed_peak_rss(command, stdout=bench.work / "runs" / f"{run}.log")
            entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            seconds = [e["step_seconds"] for e in entries if "loss" in e]
            lengths = [e["completions/mean_length"] for e in entries if "loss" in e]
            runs[name].append(_measured(2 * prompts / _steady_median(seconds), peak, sum(lengths) / len(lengths)))
        for name, gradient_checkpointing in peers.items():
            result = bench.work / "runs" / f"trl-grpo-{tag}{name}-{repeat}.json"
            _, peak = _timed_peak_rss([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "trl_grpo.py"), str(model), str(prompts_file), str(steps),
                str(prompts), str(generations), str(new_tokens), str(result), str(int(gradient_checkpointing)),
                str(repeat),
            ])  # fmt: skip
            trl = json.loads(result.read_text())
            rate = 2 * prompts / _steady_median(trl["step_seconds"])
            runs[name].append(_measured(rate, peak, trl.get("completion_tokens", float("nan"))))
    median = _medians(runs)
    for name, measured in runs.items():  # lengths: the mean of every repetition's draws (each its own seed)
        median[name]["completion_tokens"] = statistics.fmean(m["completion_tokens"] for m in measured)
    if checkpointing:  # TRL at its best: its faster setting, with that setting's memory
        best = max(peers, key=lambda name: median[name]["prompts_per_second"])
        median["trl"] = {**median[best], "setting": best}
    ratios = {
        name: {
            "prompts_per_second": median[name]["prompts_per_second"] / median["trl"]["prompts_per_second"],
            "peak_rss": median[name]["peak_rss_bytes"] / median["trl"]["peak_rss_bytes"],
        }
        for name in contenders
    }
    return {
        "prompt_tokens": _prompt_tokens(model, prompts_file), "prompts_per_step": 2 * prompts,
        "generations": generations, "new_tokens": new_tokens, "runs": runs, "median": median, "ratios": ratios,
    }  # fmt: skip


def _prompt_tokens(model: Path, prompts_file: Path) -> float:
    """The prompts' mean length in tokens, rendered with the chat template's generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = [json.loads(line) for line in prompts_file.read_text().splitlines()[:500]]
    rendered = [
        tokenizer.apply_chat_template(s["prompt"], add_generation_prompt=True, return_dict=True) for s in samples
    ]
    lengths = [len(r["input_ids"]) for r in rendered]
    return sum(lengths) / len(lengths)


def _row_layouts(model_dir, generations: int, new_tokens: int, repeats: int) -> list[dict]:
    """One training forward and backward of 4 prompts' completions in the rows GRPO trains on (a prompt shared by
    its completions, `finetune.engine.shared_attention`) and in a row per completion, in this process (one thread), for
    prompts of 10 and 150 tokens (the two shapes'): the median seconds of each over `repeats` interleaved runs."""
    import statistics
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from finetune.data.pack import with_host_indices
    from finetune.data.rollout import separate_rows, shared_rows
    from finetune.engine import shared_attention
    from finetune.objectives.loss import token_logps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the 2 training processes runs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    shared_attention.register()
    model.set_attn_implementation(shared_attention.NAME)
    results = []
    for prompt_tokens in (10, 150):
        prompts = [[5] * prompt_tokens] * (4 * generations)
        completions = [[7] * new_tokens] * (4 * generations)
        layouts = {
            "shared": shared_rows(prompts, completions, generations, 0),
            "separate": separate_rows(prompts, completions, 0),
        }
        seconds: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(1 + repeats):  # the first round warms up, uncounted
            for name, rows in layouts.items():
                began = time.perf_counter()
                token_logps(model, with_host_indices(dict(rows)), "chunked").sum().backward()
                seconds[name].append(time.perf_counter() - began)
        medians = {n: statistics.median(s[1:]) for n, s in seconds.items()}
        results.append(
            {"prompt_tokens": prompt_tokens, "generations": generations, "new_tokens": new_tokens, **medians}
        )
    torch.set_num_threads(threads)
    return results


def _measured(rate: float, peak: int, mean_length: float) -> dict:
    return {"prompts_per_second": rate, "peak_rss_bytes": peak, "completion_tokens": mean_length}


def rows(grpo: dict) -> list[str]:
    rows = []
    targets = grpo["targets"]
    engines = {
        "finetune_ddp": "DDP both", "finetune_fsdp2": "FSDP2 vs DDP",
        "finetune_fsdp2_ac": "FSDP2 with activation checkpointing vs DDP",
    }  # fmt: skip
    for result in grpo["shapes"].values():
        median = result["median"]
        trl = median["trl"].get("setting", "trl").replace("trl_no_gc", "TRL without").replace("trl_gc", "TRL with")
        ours_long = median[next(iter(result["ratios"]))]["completion_tokens"]
        trl_long = median["trl"]["completion_tokens"]
        setup = (f"{grpo['size']}, {result['prompts_per_step']} prompts of {result['prompt_tokens']:.0f} tokens x "
                 f"{result['generations']} completions of up to {result['new_tokens']} tokens a step, completions "
                 f"{ours_long:.0f} vs {trl_long:.0f} tokens")  # fmt: skip
        if abs(ours_long / trl_long - 1) > 0.1:  # the two sides did not do the same work: say so where it is read
            setup += f" (not within 10%: {ours_long / trl_long - 1:+.0%})"
        if trl != "trl":
            setup += f"; {trl} gradient checkpointing, its faster"
        for name in result["ratios"]:
            engine = engines[name]
            ours, theirs, ratios = median[name], median["trl"], result["ratios"][name]
            rows += [
                _row(
                    f"GRPO prompts/s through whole steps vs TRL GRPOTrainer {grpo['trl_version']} ({setup}; {engine})",
                    f"{ours['prompts_per_second']:.2f}", f"{theirs['prompts_per_second']:.2f}",
                    f"{ratios['prompts_per_second']:.2f}x", f">= {targets['prompts_per_second']}x",
                ),
                _row(
                    f"GRPO peak RSS of the largest process ({setup}; {engine})",
                    f"{ours['peak_rss_bytes'] / MIB:.0f} MiB", f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB",
                    f"{ratios['peak_rss']:.2f}x", f"<= {targets['peak_rss']}x",
                ),
            ]  # fmt: skip
    for case in grpo.get("layouts", []):
        rows.append(_row(
            f"GRPO training rows, one forward and backward of 4 prompts of {case['prompt_tokens']} tokens x "
            f"{case['generations']} completions of {case['new_tokens']} (shared prompt rows vs a row per completion)",
            f"{case['shared']:.3f} s", f"{case['separate']:.3f} s", f"{case['separate'] / case['shared']:.2f}x",
        ))  # fmt: skip
    return rows
