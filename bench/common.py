"""What every comparison of `make bench` shares: the work folder with its models and data (`Bench`), launching
finetune runs, timing commands with their peak memory, medians of interleaved repetitions, and table rows."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


CONFIGS = REPO / "accelerate_configs"


RECIPE = REPO / "recipes" / "demo" / "tiny_llama.yaml"


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Size:
    """A Llama shape for the benchmarks; the vocabulary is padded past the demo tokenizer's."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int = 384


SIZES = {
    "tiny": Size("tiny", 128, 4, 384, 4),
    "small": Size("small", 256, 6, 768, 8),
    "medium": Size("medium", 512, 8, 1536, 8),
    # 66M parameters with a real model's vocabulary (32,000, Llama-2's and Mistral's): weights, gradients and
    # optimizer states (and TRL's reference) outweigh the libraries, and the logits over the vocabulary, the largest
    # activation of preference tuning (chosen and rejected, policy and reference), are what they are in practice.
    "dpo": Size("dpo", 512, 8, 2048, 8, vocab=32000),
    # Several hundred million parameters, for the export comparison only (never trained beyond one step).
    "export": Size("export", 1024, 24, 2816, 16, vocab=32000),
}


# The adapters every LoRA benchmark trains: rank 16 on every linear layer, no dropout.
LORA = {"peft.r": 16, "peft.alpha": 32, "peft.dropout": 0.0, "peft.target_modules": "[all-linear]"}


# ---- measurement helpers ---------------------------------------------------------------------


def _run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(
            f"bench: {' '.join(command[:6])} ... failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )


def _timed_peak_rss(command: list[str], stdout: Path | None = None, env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak resident bytes of `command`'s largest process, started from a small process
    (bench/peak_rss.py); its output is kept in `stdout` if given."""
    keep = ["--stdout", str(stdout)] if stdout else []
    wrapper = [sys.executable, str(REPO / "bench" / "peak_rss.py"), *keep, *command]
    result = subprocess.run(wrapper, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"bench: {' '.join(command[:6])} ... failed:\n{result.stderr[-4000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return measured["seconds"], measured["peak_rss_bytes"]


def _metrics(path: Path) -> dict:
    """Per-step series from a run's metrics.jsonl, and its step-1 memory report."""
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [e for e in entries if "loss" in e]
    memory = next(e for e in entries if "memory/rank0/parameters" in e)
    return {
        "loss": [e["loss"] for e in steps],
        "step_seconds": [e["step_seconds"] for e in steps],
        "target_tokens": [e["target_tokens"] for e in steps],
        "checkpoint_seconds": [e["checkpoint_seconds"] for e in entries if "checkpoint_seconds" in e],
        "memory": {k: v for k, v in memory.items() if k.startswith("memory/rank0/")},
    }


def _medians(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender, the median of each measured field over its repetitions."""
    return {
        name: {key: statistics.median(r[key] for r in values) for key in values[0]} for name, values in runs.items()
    }


def _steady(values: list[float]) -> list[float]:
    """Drop the first steps (allocations, first collectives, caches) when there are enough."""
    return values[2:] if len(values) > 4 else values


def _steady_median(step_seconds: list[float]) -> float:
    return statistics.median(_steady(step_seconds))


def _steady_rate(tokens: list[int], step_seconds: list[float]) -> float:
    return sum(_steady(tokens)) / sum(_steady(step_seconds))


def _ratio(
    metric: str, a: str, a_values: list[float], b: str, b_values: list[float], target: float, size: Size
) -> dict:
    return {
        "metric": metric,
        "size": size.name,
        "runs": {a: a_values, b: b_values},
        "median": {a: statistics.median(a_values), b: statistics.median(b_values)},
        "ratio": statistics.median(a_values) / statistics.median(b_values),
        "target": target,
    }


def _settings(command: list[str]) -> str:
    """The recipe a `finetune train` command resolves to, its output folder left out: two commands that set the
    same values (one by default, the other by hand) give the same string."""
    from finetune.config import load_recipe

    start = command.index("finetune") + 2  # -m finetune train RECIPE OVERRIDES...
    settings = dataclasses.asdict(load_recipe(command[start], command[start + 1 :]))
    settings["output"].pop("dir")
    return json.dumps(settings, sort_keys=True, default=str)


def _parameters(model_dir: Path) -> int:
    from transformers import AutoConfig

    from finetune.model.loading import meta_model

    return sum(p.numel() for p in meta_model(AutoConfig.from_pretrained(model_dir)).parameters())


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _free_port() -> int:
    from finetune.engine.processes import free_port

    return free_port()


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


MIB = 2**20


def _row(comparison: str, finetune: str, peer: str, ratio: str = "", target: str = "") -> str:
    """One row of the comparison table; an empty cell is written "| |"."""
    cells = (comparison, finetune, peer, ratio, target)
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


class Bench:
    def __init__(self, work: Path, quick: bool, repeats: int):
        self.work, self.quick, self.repeats = work, quick, repeats
        self.curves: dict[str, list[float]] = {}  # loss curves to plot
        self.launched: dict[tuple, Path] = {}  # a quick run's launches (their settings) and their folders
        work.mkdir(parents=True, exist_ok=True)
        from finetune.run import demo

        demo.build(str(work / "demo"))  # tokenizer and chat data (offline)
        self.data = work / "demo" / "data" / "train.jsonl"
        self.steps = 6 if quick else 30
        self.train_size = SIZES["tiny" if quick else "small"]

    # ---- assets -------------------------------------------------------------------------------

    def model(self, size: Size, experts: int = 0) -> Path:
        """A randomly initialised Llama of `size`, or with `experts` a Qwen3-MoE of its width and depth with that
        many experts of a quarter of its MLP width, 2 per token; saved once with the demo tokenizer."""
        folder = self.work / "models" / (f"{size.name}-moe" if experts else size.name)
        if (folder / "config.json").exists():
            return folder
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.work / "demo" / "base")
        torch.manual_seed(0)
        shape = dict(
            vocab_size=max(size.vocab, len(tokenizer)), hidden_size=size.hidden, intermediate_size=size.intermediate,
            num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
            max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        if experts:
            moe = dict(moe_intermediate_size=size.intermediate // 4, num_experts=experts, num_experts_per_tok=2)
            config = AutoConfig.for_model("qwen3_moe", **shape, **moe, head_dim=size.hidden // size.heads)
        else:
            config = AutoConfig.for_model("llama", **shape)
        partial = folder.with_suffix(".partial")
        AutoModelForCausalLM.from_config(config).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(folder)
        return folder

    def finetune_run(
        self, name: str, size: Size, config: str, processes: int = 2, launch_args: tuple[str, ...] = (), **overrides
    ) -> dict:
        """One `accelerate launch -m finetune train` of the demo recipe on the bench model; its metrics.

        A quick run proves that the comparisons run, and times nothing: a launch the same as one it made already
        (several comparisons' baselines are the same tiny run) is not made again, its folder linked under `name`."""
        command, out = self.finetune_command(name, size, config, processes, launch_args, **overrides)
        same = (config, processes, launch_args, _settings(command)) if self.quick else None
        if same in self.launched:
            if out.is_symlink():
                out.unlink()
            shutil.rmtree(out, ignore_errors=True)  # a former bench's, in the same --work
            out.symlink_to(self.launched[same], target_is_directory=True)
            return _metrics(out / "metrics.jsonl")
        _run(command)
        if same is not None:
            self.launched[same] = out
        return _metrics(out / "metrics.jsonl")

    def finetune_command(
        self,
        name: str,
        size: Size,
        config: str,
        processes: int = 2,
        launch_args: tuple[str, ...] = (),
        recipe: Path = RECIPE,
        **overrides,
    ) -> tuple[list[str], Path]:
        """The launch of `finetune_run` (of the demo recipe, or `recipe`), and the output folder it writes."""
        out = self.work / "runs" / name
        values = {
            "model.name_or_path": self.model(size),
            "data.train_path": self.data,
            "data.eval_path": "null",
            "eval.generate": "null",  # the demo recipe's evaluation by generation needs eval data
            "output.dir": out,
            "output.overwrite": "true",
            "output.trackers": "[]",
            "output.export": "false",
            "train.max_steps": self.steps,
            "train.log_every_steps": 1,
            "train.eval_every_steps": 0,
            "optim.lr": "1e-4",
            "optim.warmup_steps": 0,
            "optim.schedule": "constant",
            "train.global_batch_size": "null",  # each bench sets its micro-batch per process
            **overrides,
        }
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
            "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", str(_free_port()),
            *launch_args, "-m", "finetune", "train", str(recipe), *[f"{k}={v}" for k, v in values.items()],
        ]  # fmt: skip
        return command, out
