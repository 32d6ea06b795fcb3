"""Shared fixtures: tiny offline assets and real multi-process runs that several tests assert on."""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from helpers import CHECKPOINT_SETTINGS, GPT2_WRAP, LaunchedRun, run_in

T = TypeVar("T")

# One thread a process, as torchrun gives each of several processes. The tests' models are tiny: a second OpenMP
# thread mostly waits at each operation's barrier, and while the other pytest worker's launched runs hold the cores
# it waits descheduled (measured: the demo's report, 17 s on one thread, took 20 s on two, and 70 s on two beside a
# 2-process run). For this process and every process a test starts; an OMP_NUM_THREADS set by hand wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """What `build(folder)` returns, built once per test session in a folder of its own.

    `make test` runs two pytest workers, and each has session fixtures of its own: a run that files on both
    workers use would be launched twice. So the folder is in the session's root, which the workers share: the
    first worker to ask builds it while the other waits on a lock, then both read it (tests read these folders
    and copy what they change). Alone (`pytest` without `-n`), it is an ordinary session fixture.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's temporary root is a folder of the session's
    shared = root / "built_once"
    shared.mkdir(exist_ok=True)
    folder, value = shared / name, shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not value.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed on the other worker left
            folder.mkdir()
            value.write_bytes(pickle.dumps(build(folder)))
        return pickle.loads(value.read_bytes())


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    """The demo's base model, tokenizer and data, built offline by the real `finetune demo build`."""
    from finetune.run import demo

    def build(root: Path) -> Path:
        demo.build(str(root))
        return root

    return built_once(tmp_path_factory, "demo", build)


@pytest.fixture(scope="session")
def partly_trained(tmp_path_factory, demo_assets):
    """The demo model after 100 steps of 16 lists on one process: it reverses some held-out lists and not others
    (evaluation by generation, online RL)."""
    settings = {
        "train.max_steps": 100,
        "train.micro_batch_size": 16,
        "train.eval_every_steps": 0,
        "data.eval_path": "null",
    }

    def build(folder: Path) -> Path:
        return run_in(folder / "out", demo_assets, "single_gpu.yaml", num_processes=1, **settings).output_dir / "final"

    return built_once(tmp_path_factory, "partly", build)


def shared_run(tmp_path_factory, assets: Path, name: str, config: str, **options) -> LaunchedRun:
    """A launched run (`run_in`'s) that every test file of the session reads: launched once."""
    return built_once(tmp_path_factory, name, lambda folder: run_in(folder / "out", assets, config, **options))


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 full shard, packed chat data, tensorboard tracker on."""
    return shared_run(
        tmp_path_factory, demo_assets, "fsdp2", "fsdp2_full_shard.yaml", **{"output.trackers": "[tensorboard]"}
    )


@pytest.fixture(scope="session")
def shard_grad_op_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 shard-grad-op with gradient accumulation."""
    return shared_run(
        tmp_path_factory, demo_assets, "sgo", "fsdp2_shard_grad_op.yaml", **{"train.gradient_accumulation_steps": 2}
    )


@pytest.fixture(scope="session")
def fsdp1_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP1 full shard on padded (not packed) batches."""
    return shared_run(tmp_path_factory, demo_assets, "fsdp1", "fsdp1_full_shard.yaml", **{"data.packing": "false"})


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """DDP with gradient accumulation (no_sync on all but the last micro-batch)."""
    return shared_run(tmp_path_factory, demo_assets, "ddp", "ddp.yaml", **{"train.gradient_accumulation_steps": 2})


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """The FSDP2 config on 1 process (a 1-rank group: SHARDED checkpoints), micro-batch 16: the same
    global batch of 16 rows as the 2-process runs of CHECKPOINT_SETTINGS."""
    return shared_run(
        tmp_path_factory, demo_assets, "one", "fsdp2_full_shard.yaml", num_processes=1,
        **CHECKPOINT_SETTINGS, **{"train.micro_batch_size": 16},
    )  # fmt: skip


@pytest.fixture(scope="session")
def gpt2_base(tmp_path_factory, demo_assets) -> Path:
    """A tiny GPT-2 with tied input and output embeddings, saved like a hub model."""

    def build(folder: Path) -> Path:
        from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

        base = folder / "base"
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

    return built_once(tmp_path_factory, "gpt2", build)


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory, demo_assets, gpt2_base) -> LaunchedRun:
    """The tied GPT-2 under FSDP2 full shard on 2 processes: SHARDED checkpoints."""
    return shared_run(
        tmp_path_factory, demo_assets, "gpt2_run", "fsdp2_full_shard.yaml", launch_args=GPT2_WRAP,
        **{"model.name_or_path": gpt2_base},
    )  # fmt: skip


@pytest.fixture(scope="session")
def gpt2_full_one_process_run(tmp_path_factory, demo_assets, gpt2_base) -> LaunchedRun:
    """The tied GPT-2 on 1 process with the shard-grad-op config: FULL checkpoints."""
    return shared_run(
        tmp_path_factory, demo_assets, "gpt2_full", "fsdp2_shard_grad_op.yaml", num_processes=1,
        launch_args=GPT2_WRAP, **{"model.name_or_path": gpt2_base, "train.max_steps": 4, "train.eval_every_steps": 0},
    )  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test on a launched run (a fixture named `*_run`) starts processes: marked `multiprocess` whether or not
    it says so, so that `-m "not multiprocess"` starts none. Tests marked `cuda` run where a GPU is (`make
    test-gpu`); elsewhere they are skipped, saying why."""
    for item in items:
        if any(name.endswith("_run") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run make test-gpu on a machine with one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def no_launch_in_fast_tests():
    """`make test-fast` (FINETUNE_FAST_TESTS=1): a test that starts a distributed launch fails, naming it, so that
    the markers stay right (a test that launches is marked `multiprocess`, or uses a `*_run` fixture)."""
    if os.environ.get("FINETUNE_FAST_TESTS") != "1":
        yield
        return
    original = subprocess.Popen.__init__

    def refuse_launches(self, args, *rest, **options):
        words = [str(word) for word in (args if isinstance(args, list | tuple) else [args])]
        if any(word in ("accelerate.commands.launch", "torch.distributed.run", "torchrun") for word in words):
            raise AssertionError(
                f"make test-fast started a launch ({' '.join(words[:6])} ...): mark the test multiprocess"
            )
        original(self, args, *rest, **options)

    subprocess.Popen.__init__ = refuse_launches
    yield
    subprocess.Popen.__init__ = original
