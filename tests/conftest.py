"""Shared fixtures: tiny offline assets and real multi-process runs that several tests assert on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from finetune.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "recipes" / "demo" / "tiny_llama.yaml"
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

    def rank_reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.output_dir / "ranks").glob("rank_*.json"))]


def launch(
    config: str, overrides: list[str], *, num_processes: int = 2, launch_args: tuple[str, ...] = (), env=None
) -> subprocess.CompletedProcess:
    """Start real processes with `accelerate launch`, exactly as a user would."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / config),
        "--num_processes", str(num_processes),
        "--mixed_precision", "no",
        "--main_process_port", str(free_port()),
        *launch_args,
        "-m", "finetune", "train", str(DEMO_RECIPE), *overrides,
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


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    """The demo's base model, tokenizer and data, built offline by the real `finetune demo build`."""
    from finetune import demo

    root = tmp_path_factory.mktemp("demo")
    demo.build(str(root))
    return root


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
        **extra,
    }
    return [f"{key}={value}" for key, value in values.items()]


def _run(tmp_path_factory, assets: Path, name: str, config: str, num_processes: int = 2, **extra) -> LaunchedRun:
    output_dir = tmp_path_factory.mktemp(name) / "out"
    result = launch(config, recipe_overrides(assets, output_dir, **extra), num_processes=num_processes)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 full shard, packed chat data, tensorboard tracker on."""
    return _run(
        tmp_path_factory, demo_assets, "fsdp2", "fsdp2_full_shard.yaml", **{"output.trackers": "[tensorboard]"}
    )


@pytest.fixture(scope="session")
def shard_grad_op_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 shard-grad-op with gradient accumulation."""
    return _run(
        tmp_path_factory, demo_assets, "sgo", "fsdp2_shard_grad_op.yaml", **{"train.gradient_accumulation_steps": 2}
    )


@pytest.fixture(scope="session")
def fsdp1_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP1 full shard on padded (not packed) batches."""
    return _run(tmp_path_factory, demo_assets, "fsdp1", "fsdp1_full_shard.yaml", **{"data.packing": "false"})


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """DDP with gradient accumulation (no_sync on all but the last micro-batch)."""
    return _run(tmp_path_factory, demo_assets, "ddp", "ddp.yaml", **{"train.gradient_accumulation_steps": 2})


# Short runs that checkpoint every 2 steps and keep the last 2 checkpoints.
CHECKPOINT_SETTINGS = {
    "train.max_steps": 8,
    "train.eval_every_steps": 0,
    "data.eval_path": "null",
    "checkpoint.save_every_steps": 2,
    "checkpoint.keep_last": 2,
}


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """The FSDP2 config on 1 process (a 1-rank group: SHARDED checkpoints), micro-batch 16: the same
    global batch of 16 rows as the 2-process runs of CHECKPOINT_SETTINGS."""
    return _run(
        tmp_path_factory, demo_assets, "one", "fsdp2_full_shard.yaml", num_processes=1,
        **CHECKPOINT_SETTINGS, **{"train.micro_batch_size": 16},
    )  # fmt: skip


@pytest.fixture(scope="session")
def gpt2_base(tmp_path_factory, demo_assets) -> Path:
    """A tiny GPT-2 with tied input and output embeddings, saved like a hub model."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    base = tmp_path_factory.mktemp("gpt2") / "base"
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


GPT2_WRAP = ("--fsdp_transformer_layer_cls_to_wrap", "GPT2Block")


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory, demo_assets, gpt2_base) -> LaunchedRun:
    """The tied GPT-2 under FSDP2 full shard on 2 processes: SHARDED checkpoints."""
    output_dir = tmp_path_factory.mktemp("gpt2_run") / "out"
    overrides = recipe_overrides(demo_assets, output_dir, **{"model.name_or_path": gpt2_base})
    result = launch("fsdp2_full_shard.yaml", overrides, launch_args=GPT2_WRAP)
    assert result.returncode == 0, result.stderr[-4000:]
    return LaunchedRun(result, output_dir)


@pytest.fixture(scope="session")
def gpt2_full_one_process_run(tmp_path_factory, demo_assets, gpt2_base) -> LaunchedRun:
    """The tied GPT-2 on 1 process with the shard-grad-op config: FULL checkpoints."""
    output_dir = tmp_path_factory.mktemp("gpt2_full") / "out"
    overrides = recipe_overrides(
        demo_assets, output_dir, **{"model.name_or_path": gpt2_base, "train.max_steps": 4, "train.eval_every_steps": 0}
    )
    result = launch("fsdp2_shard_grad_op.yaml", overrides, num_processes=1, launch_args=GPT2_WRAP)
    assert result.returncode == 0, result.stderr[-4000:]
    return LaunchedRun(result, output_dir)


def per_sample_eval_loss(model, tokenizer, eval_path: Path) -> float:
    """Loss per target token over an eval file, each sample scored on its own (no packing, no padding)."""
    import torch

    from finetune.config import DataConfig
    from finetune.data import IGNORE, collate_padded, load_split, prepare_split
    from finetune.loss import batch_loss

    cfg = DataConfig(train_path=str(eval_path), max_length=128, packing=False)
    samples, _ = prepare_split(load_split(cfg.train_path, "train"), tokenizer, cfg, seed=0)
    loss_sum, num_targets = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            batch = collate_padded([sample], tokenizer.pad_token_id)
            loss_sum += batch_loss(model, batch, "full_logits").total.item()
            num_targets += int((batch["target_ids"] != IGNORE).sum())
    return loss_sum / num_targets


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test on a launched run (a fixture named `*_run`) starts processes: marked `multiprocess` whether or not
    it says so, so that `-m "not multiprocess"` starts none. Tests marked `cuda` run where a GPU is (`make
    test-gpu`); elsewhere they are skipped, saying why."""
    import torch

    for item in items:
        if any(name.endswith("_run") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run make test-gpu on a machine with one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
