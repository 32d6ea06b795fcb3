"""agent: online RL over episodes that call a tool, episodes/s through whole steps and peak RSS vs TRL GRPOTrainer"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from common import MIB, REPO, Bench, _free_port, _medians, _row, _run, _steady_median, _timed_peak_rss, _version

AGENT_SFT, AGENT_GRPO = REPO / "recipes" / "demo" / "agent_sft.yaml", REPO / "recipes" / "demo" / "agent_grpo.yaml"
TURNS, NEW_TOKENS, GENERATIONS, PROMPTS = 3, 96, 8, 2
"""Both sides: model turns an episode (TRL: one more than its tool iterations), ids after the prompt (the tool's
answers count on both), completions a prompt, prompts a process a step."""


def measure(bench: Bench) -> dict:
    """finetune's episodes (`rl.tools`, FSDP2 and DDP) against TRL's GRPOTrainer with `tools` (bench/trl_agent.py,
    DDP), 2 processes each, on one model: the agent demo's task (`lookup` a list by its key, answer it reversed)
    with a tokenizer that writes Qwen2.5's chat template (TRL's tool mode reads only the templates it knows; its
    copy of Qwen2.5's is the one used, so that TRL recognises it), warmed by finetune's SFT on the demo's traces
    so that episodes call the tool and go on after its answer. The same prompts, tool, turns, budget, group size,
    temperature 1, DAPO's loss, beta 0, one update per rollout, fp32; repetition k seeds both sides with k. Measured:
    episodes/s (completions through whole steps: decoding, the tool, scoring, forward, backward, update), the peak
    RSS of the largest process, and what each side's episodes held: tool calls and model-written ids per episode
    (TRL's `tools/call_frequency` and `completions/mean_length`, finetune's `tools/call_frequency` and
    `episodes/written_tokens`), so that the two can be seen to have done the same work."""
    model, prompts_file = _warm_agent(bench)
    steps = 2 if bench.quick else 8
    generations = 4 if bench.quick else GENERATIONS
    settings = {
        "model.name_or_path": model, "data.train_path": prompts_file, "data.max_length": 320 + NEW_TOKENS,
        "rl.max_new_tokens": NEW_TOKENS, "rl.max_turns": TURNS, "rl.num_generations": generations,
        "rl.temperature": 1.0, "rl.loss": "dapo", "rl.beta": 0.0, "train.micro_batch_size": PROMPTS,
        "train.max_steps": steps, "data.eval_path": "null",
    }  # fmt: skip
    contenders = {"finetune_fsdp2": "fsdp2_full_shard.yaml", "finetune_ddp": "ddp.yaml"}
    if bench.quick:  # one of each side
        del contenders["finetune_ddp"]
    runs: dict[str, list[dict]] = {name: [] for name in [*contenders, "trl"]}
    (bench.work / "runs").mkdir(parents=True, exist_ok=True)
    for repeat in range(bench.repeats):
        for name, config in contenders.items():
            run = f"agent-{name}-{repeat}"
            command, out = bench.finetune_command(
                run, bench.train_size, config, recipe=AGENT_GRPO, **settings, **{"train.seed": repeat}
            )
            _, peak = _timed_peak_rss(command, stdout=bench.work / "runs" / f"{run}.log")
            steps_logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps_logged = [e for e in steps_logged if "loss" in e]
            runs[name].append(_measured(
                2 * PROMPTS * generations / _steady_median([e["step_seconds"] for e in steps_logged]), peak,
                [e.get("tools/call_frequency", 0.0) for e in steps_logged],
                [e.get("episodes/written_tokens", 0.0) for e in steps_logged],
            ))  # fmt: skip
        result = bench.work / "runs" / f"trl-agent-{repeat}.json"
        _, peak = _timed_peak_rss([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
            str(REPO / "bench" / "trl_agent.py"), str(model), str(prompts_file), str(steps), str(PROMPTS),
            str(generations), str(NEW_TOKENS), str(TURNS), str(result), str(repeat),
        ], stdout=bench.work / "runs" / f"trl-agent-{repeat}.log")  # fmt: skip
        trl = json.loads(result.read_text())
        runs["trl"].append(_measured(
            2 * PROMPTS * generations / _steady_median(trl["step_seconds"]), peak, trl["calls_per_step"],
            trl["completion_tokens_per_step"],
        ))  # fmt: skip
    median = _medians(runs)
    for name, measured in runs.items():  # what the episodes held: the mean over every repetition's draws
        for key in ("calls", "written_tokens"):
            median[name][key] = statistics.fmean(m[key] for m in measured)
    ratios = {
        name: {
            "episodes_per_second": median[name]["episodes_per_second"] / median["trl"]["episodes_per_second"],
            "peak_rss": median[name]["peak_rss_bytes"] / median["trl"]["peak_rss_bytes"],
        }
        for name in contenders
    }
    return {
        "episodes_per_step": 2 * PROMPTS * generations, "turns": TURNS, "new_tokens": NEW_TOKENS, "runs": runs,
        "median": median, "ratios": ratios, "targets": {"episodes_per_second": 1.3, "peak_rss": 1.0},
        "trl_version": _version("trl"),
    }  # fmt: skip


def _warm_agent(bench: Bench) -> tuple[Path, Path]:
    """The agent demo's base and data with Qwen2.5's chat template (TRL's copy), and the model after finetune's
    SFT on its traces (once; reused); the prompts file."""
    import trl

    from finetune.run import demo_agent

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    chat = demo_agent.ChatFormat(
        template=template, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None,
        eos="<|im_end|>", pad="<|endoftext|>", vocab_size=512, positions=512,
    )  # fmt: skip
    root = demo_agent.build(str(bench.work), "agent-qwen", chat)
    if bench.quick:  # the scripts run end to end: the base (its episodes seldom call) spares the SFT launch
        return root / "base", root / "data" / "prompts_train.jsonl"
    warm = root / "run-sft" / "final"
    if not (warm / "config.json").exists():
        command, _ = bench.finetune_command(
            "agent-sft", bench.train_size, "fsdp2_full_shard.yaml", recipe=AGENT_SFT,
            **{"model.name_or_path": root / "base", "data.train_path": root / "data" / "sft_train.jsonl",
               "data.max_length": 320, "train.max_steps": 150, "output.dir": root / "run-sft",
               "output.export": "true", "optim.lr": "3e-3", "optim.schedule": "cosine", "optim.warmup_steps": 10,
               "train.micro_batch_size": 8},
        )  # fmt: skip
        _run(command)
    return warm, root / "data" / "prompts_train.jsonl"


def _measured(rate: float, peak: int, calls: list[float], written: list[float]) -> dict:
    return {
        "episodes_per_second": rate, "peak_rss_bytes": peak, "calls": statistics.fmean(calls or [0.0]),
        "written_tokens": statistics.fmean(written or [0.0]),
    }  # fmt: skip


def rows(agent: dict) -> list[str]:
    median, targets = agent["median"], agent["targets"]
    engines = {"finetune_fsdp2": "FSDP2 vs DDP", "finetune_ddp": "DDP both"}
    rows = []
    for name, ratios in agent["ratios"].items():
        ours, theirs = median[name], median["trl"]
        setup = (f"{agent['episodes_per_step']} episodes a step of up to {agent['turns']} turns and "
                 f"{agent['new_tokens']} ids, calls {ours['calls']:.2f} vs {theirs['calls']:.2f} and model-written "
                 f"ids {ours['written_tokens']:.1f} vs {theirs['written_tokens']:.1f} an episode")  # fmt: skip
        for key, what in (("written_tokens", "ids"), ("calls", "calls")):  # unequal work is said where it is read
            if abs(ours[key] - theirs[key]) > 0.1 * max(ours[key], theirs[key]):
                setup += f" ({what} not within 10%: {ours[key] / max(theirs[key], 1e-9) - 1:+.0%})"
        rows += [
            _row(
                f"Agent episodes/s through whole steps vs TRL GRPOTrainer with tools {agent['trl_version']} "
                f"({setup}; {engines[name]})",
                f"{ours['episodes_per_second']:.2f}", f"{theirs['episodes_per_second']:.2f}",
                f"{ratios['episodes_per_second']:.2f}x", f">= {targets['episodes_per_second']}x",
            ),
            _row(
                f"Agent peak RSS of the largest process ({engines[name]})",
                f"{ours['peak_rss_bytes'] / MIB:.0f} MiB", f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB",
                f"{ratios['peak_rss']:.2f}x", f"<= {targets['peak_rss']}x",
            ),
        ]  # fmt: skip
    return rows
