"""grpo: online RL prompts/s through whole steps (generation included) and peak RSS vs TRL GRPOTrainer"""

from __future__ import annotations

import json
import sys

from common import MIB, REPO, Bench, _free_port, _medians, _row, _steady_median, _timed_peak_rss, _version

GRPO_RECIPE = REPO / "recipes" / "demo" / "tiny_llama_grpo.yaml"


def measure(bench: Bench) -> dict:
    """GRPO against TRL's GRPOTrainer (bench/trl_grpo.py), 2 processes, the same randomly initialised model, demo
    prompts, exact-reversal reward, 8 completions a prompt, the same number of new tokens, temperature 1, DAPO's
    loss, beta 0, one update per rollout, fp32 both: prompts per second through whole steps (sampling, scoring,
    the forward and backward, the update) and the peak resident memory of the largest process. A randomly
    initialised model rarely stops before the length limit: both generate about the same tokens. finetune under
    DDP (TRL's engine) and FSDP2."""
    size = bench.train_size
    model = bench.model(size)
    prompts_file = bench.work / "demo" / "data" / "prompts_train.jsonl"
    prompts, generations, new_tokens, steps = (2, 4, 8, 3) if bench.quick else (4, 8, 32, 8)
    settings = {
        "data.train_path": prompts_file, "data.max_length": 32 + new_tokens, "data.packing": "false",
        "data.format": "auto", "rl.num_generations": generations, "rl.max_new_tokens": new_tokens,
        "rl.temperature": 1.0, "rl.loss": "dapo", "rl.beta": 0.0, "train.micro_batch_size": prompts,
        "train.max_steps": steps,
    }  # fmt: skip
    contenders = {"finetune_ddp": "ddp.yaml", "finetune_fsdp2": "fsdp2_full_shard.yaml"}
    runs: dict[str, list[dict]] = {name: [] for name in [*contenders, "trl"]}
    (bench.work / "runs").mkdir(parents=True, exist_ok=True)
    for repeat in range(bench.repeats):
        for name, config in contenders.items():
            command, out = bench.finetune_command(f"grpo-{name}-{repeat}", size, config, recipe=GRPO_RECIPE,
                                                  **settings)  # fmt: skip
            _, peak = _timed_peak_rss(command, stdout=bench.work / "runs" / f"grpo-{name}-{repeat}.log")
            entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            seconds = [e["step_seconds"] for e in entries if "loss" in e]
            lengths = [e["completions/mean_length"] for e in entries if "loss" in e]
            runs[name].append(_measured(2 * prompts / _steady_median(seconds), peak, sum(lengths) / len(lengths)))
        result = bench.work / "runs" / f"trl-grpo-{repeat}.json"
        _, peak = _timed_peak_rss([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(REPO / "bench" / "trl_grpo.py"), str(model), str(prompts_file), str(steps),
            str(prompts), str(generations), str(new_tokens), str(result),
        ])  # fmt: skip
        trl = json.loads(result.read_text())
        runs["trl"].append(_measured(2 * prompts / _steady_median(trl["step_seconds"]), peak, float("nan")))
    median = _medians(runs)
    layouts = _row_layouts(model, generations, new_tokens, bench.repeats)
    ratios = {
        name: {
            "prompts_per_second": median[name]["prompts_per_second"] / median["trl"]["prompts_per_second"],
            "peak_rss": median[name]["peak_rss_bytes"] / median["trl"]["peak_rss_bytes"],
        }
        for name in contenders
    }
    return {
        "size": size.name, "prompts_per_step": 2 * prompts, "generations": generations, "new_tokens": new_tokens,
        "runs": runs, "median": median, "ratios": ratios, "targets": {"prompts_per_second": 1.5, "peak_rss": 1.0},
        "layouts": layouts,
        "trl_version": _version("trl"),
    }  # fmt: skip


def _row_layouts(model_dir, generations: int, new_tokens: int, repeats: int) -> list[dict]:
    """One training forward and backward of 4 prompts' completions in the rows GRPO trains on (a prompt shared by
    its completions, `finetune.shared_attention`) and in a row per completion, in this process (one thread), for
    prompts of 10 and 100 tokens: the median seconds of each over `repeats` interleaved runs."""
    import statistics
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from finetune import shared_attention
    from finetune.data.pack import with_host_indices
    from finetune.data.rollout import separate_rows, shared_rows
    from finetune.loss import token_logps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the 2 training processes runs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    shared_attention.register()
    model.set_attn_implementation(shared_attention.NAME)
    results = []
    for prompt_tokens in (10, 100):
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
        results.append({"prompt_tokens": prompt_tokens, **{n: statistics.median(s[1:]) for n, s in seconds.items()}})
    torch.set_num_threads(threads)
    return results


def _measured(rate: float, peak: int, mean_length: float) -> dict:
    return {"prompts_per_second": rate, "peak_rss_bytes": peak, "completion_tokens": mean_length}


def rows(grpo: dict) -> list[str]:
    rows = []
    median, targets = grpo["median"], grpo["targets"]
    setup = (f"{grpo['size']}, {grpo['prompts_per_step']} prompts x {grpo['generations']} completions of up to "
             f"{grpo['new_tokens']} tokens a step")  # fmt: skip
    for name, engine in (("finetune_ddp", "DDP both"), ("finetune_fsdp2", "FSDP2 vs DDP")):
        ours, theirs, ratios = median[name], median["trl"], grpo["ratios"][name]
        rows += [
            _row(
                f"GRPO prompts/s through whole steps vs TRL GRPOTrainer {grpo['trl_version']} ({setup}; {engine})",
                f"{ours['prompts_per_second']:.2f}", f"{theirs['prompts_per_second']:.2f}",
                f"{ratios['prompts_per_second']:.2f}x", f">= {targets['prompts_per_second']}x",
            ),
            _row(
                f"GRPO peak RSS of the largest process ({engine})",
                f"{ours['peak_rss_bytes'] / MIB:.0f} MiB", f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB",
                f"{ratios['peak_rss']:.2f}x", f"<= {targets['peak_rss']}x",
            ),
        ]  # fmt: skip
    for case in grpo.get("layouts", []):
        rows.append(_row(
            f"GRPO training rows, one forward and backward of 4 prompts of {case['prompt_tokens']} tokens x "
            f"{grpo['generations']} completions of {grpo['new_tokens']} (shared prompt rows vs a row per completion)",
            f"{case['shared']:.3f} s", f"{case['separate']:.3f} s", f"{case['separate'] / case['shared']:.2f}x",
        ))  # fmt: skip
    return rows
