"""What the tests share besides fixtures: the repository's paths, launching real runs as a user would, the
demo recipe pointed at test assets, tiny model configs, and a few checks several files make. Imported by
name (`from helpers import ...`); the fixtures that use them live in conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune.engine.processes import free_port

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "recipes" / "demo" / "tiny_llama.yaml"
GRPO_RECIPE = REPO / "recipes" / "demo" / "tiny_llama_grpo.yaml"
DISTILL_RECIPE = REPO / "recipes" / "demo" / "tiny_llama_distill.yaml"
CONFIGS = REPO / "accelerate_configs"


# Hermetic: no hub access, quiet tokenizers.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@dataclass
class LaunchedRun:
    """A finished `accelerate launch ... -m finetune train` and what it left behind."""

    result: subprocess.CompletedProcess
    output_dir: Path

    @property
    def log(self) -> str:
        return self.result.stdout + self.result.stderr

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]

    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics() if "loss" in m]

    def per_step(self) -> dict[int, dict[str, float]]:
        """What each step logged of its rollout and update: its speed, padding (which the layout decides) and
        generation time left out."""
        timed = ("tokens_per_second", "step_seconds", "step", "fill")
        return {
            m["step"]: {k: v for k, v in m.items() if k not in timed and not k.startswith("generation/")}
            for m in self.metrics()
            if "loss" in m
        }

    def rank_reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.output_dir / "ranks").glob("rank_*.json"))]


def launch(
    config: str,
    overrides: list[str],
    *,
    num_processes: int = 2,
    launch_args: tuple[str, ...] = (),
    env=None,
    recipe: Path = DEMO_RECIPE,
    program: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Start real processes with `accelerate launch`, exactly as a user would: `finetune train` on the recipe, or
    `program` (a script and its arguments) where a test drives finetune's pieces itself."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / config),
        "--num_processes", str(num_processes),
        "--mixed_precision", "no",
        "--main_process_port", str(free_port()),
        *launch_args,
        *(program or ["-m", "finetune", "train", str(recipe), *overrides]),
    ]  # fmt: skip
    # Own session, so a run that outlives its timeout is killed with all its workers, not just the launcher.
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        signal_launch(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        message = f"{' '.join(command)} did not finish in 300 s:\n{stdout[-3000:]}\n{stderr[-6000:]}"
        raise AssertionError(message) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def signal_launch(launcher_pid: int, signum: int) -> list[int]:
    """Send `signum` to an `accelerate launch` and its training processes; returns the processes' pids.

    torch's launcher starts every worker in a session of its own, so signalling the launcher's
    process group would leave the workers running.
    """
    workers = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    for pid in [launcher_pid, *map(int, workers)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return [int(pid) for pid in workers]


def recipe_overrides(assets: Path, output_dir: Path, **extra) -> list[str]:
    """Point the demo recipe at test assets and keep runs short."""
    values = {
        "model.name_or_path": assets / "base",
        "data.train_path": assets / "data" / "train.jsonl",
        "data.eval_path": assets / "data" / "eval.jsonl",
        "output.dir": output_dir,
        "output.trackers": "[]",
        "train.max_steps": 16,
        "train.eval_every_steps": 8,
        "train.log_every_steps": 1,
        "optim.warmup_steps": 2,
        # A micro-batch x accumulation x processes as each test sets them (the recipe's global batch of 16 would
        # set the accumulation by the process count): tests of the global batch set it again.
        "train.global_batch_size": "null",
        **extra,
    }
    if not any(key.startswith("eval.generate") for key in extra):
        values["eval.generate"] = "null"  # the demo recipe's evaluation by generation: only where a test asks
    return [f"{key}={value}" for key, value in values.items()]


def launched_run(
    tmp_path_factory,
    assets: Path,
    name: str,
    config: str,
    num_processes: int = 2,
    launch_args: tuple[str, ...] = (),
    **extra,
) -> LaunchedRun:
    return run_in(tmp_path_factory.mktemp(name) / "out", assets, config, num_processes, launch_args, **extra)


def run_in(
    output_dir: Path,
    assets: Path,
    config: str,
    num_processes: int = 2,
    launch_args: tuple[str, ...] = (),
    **extra,
) -> LaunchedRun:
    """`finetune train` of the demo recipe on the test assets, launched into `output_dir`; it must succeed."""
    overrides = recipe_overrides(assets, output_dir, **extra)
    result = launch(config, overrides, num_processes=num_processes, launch_args=launch_args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


# Short runs that checkpoint every 2 steps and keep the last 2 checkpoints.
CHECKPOINT_SETTINGS = {
    "train.max_steps": 8,
    "train.eval_every_steps": 0,
    "data.eval_path": "null",
    "checkpoint.save_every_steps": 2,
    "checkpoint.keep_last": 2,
}


GPT2_WRAP = ("--fsdp_transformer_layer_cls_to_wrap", "GPT2Block")


def per_sample_eval_loss(model, tokenizer, eval_path: Path) -> float:
    """Loss per target token over an eval file, each sample scored on its own (no packing, no padding)."""
    import torch

    from finetune.config import DataConfig
    from finetune.data import IGNORE, collate_padded, load_split, prepare_split
    from finetune.objectives.loss import batch_loss

    cfg = DataConfig(train_path=str(eval_path), max_length=128, packing=False)
    samples, _ = prepare_split(load_split(cfg.train_path, "train"), tokenizer, cfg, seed=0)
    loss_sum, num_targets = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            batch = collate_padded([sample], tokenizer.pad_token_id)
            loss_sum += batch_loss(model, batch, "full_logits").total.item()
            num_targets += int((batch["target_ids"] != IGNORE).sum())
    return loss_sum / num_targets


def flip_one_weight_between_samples(file: Path) -> None:
    """Flip the lowest bit of one float32 weight of a safetensors file, in place, half-way between two of the 16
    evenly spaced 4 KiB samples an earlier fingerprint read: a change as small as a re-export's, where no
    sample looked."""
    size = file.stat().st_size
    with file.open("r+b") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
        starts = [i * (size - 4096) // 15 for i in range(16)]
        middle = (starts[7] + 4096 + starts[8]) // 2
        offset = data_start + (middle - data_start) // 4 * 4  # an element's first, least significant, byte
        assert data_start < offset and starts[7] + 4096 <= offset < starts[8]
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


# Tiny shapes every family takes; each config keeps only the keys it has.
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, first_k_dense_replace=1,
    n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)  # fmt: skip


def tiny_config(model_type: str, **overrides):
    """A tiny config of any transformers model type (2 layers, hidden 64, 4 experts where it has experts)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    values = {key: value for key, value in TINY.items() if hasattr(defaults, key)}
    if hasattr(defaults, "qk_rope_head_dim"):  # multi-head latent attention: rotary on part of each head
        values["head_dim"] = values["qk_rope_head_dim"]
    if model_type == "gpt_oss":
        values["layer_types"] = ["sliding_attention", "full_attention"]
    return AutoConfig.for_model(model_type, **{**values, **overrides})
