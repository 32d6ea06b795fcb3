"""Shared fixtures: tiny offline assets and real multi-process runs that several tests assert on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import (
    CHECKPOINT_SETTINGS,
    GPT2_WRAP,
    LaunchedRun,
    launch,
    launched_run,
    recipe_overrides,
)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    """The demo's base model, tokenizer and data, built offline by the real `finetune demo build`."""
    from finetune.run import demo

    root = tmp_path_factory.mktemp("demo")
    demo.build(str(root))
    return root


@pytest.fixture(scope="session")
def partly_trained(tmp_path_factory, demo_assets):
    """The demo model after 100 steps of 16 lists on one process: it reverses some held-out lists and not others
    (evaluation by generation, online RL)."""
    output_dir = tmp_path_factory.mktemp("partly") / "out"
    overrides = recipe_overrides(
        demo_assets,
        output_dir,
        **{
            "train.max_steps": 100,
            "train.micro_batch_size": 16,
            "train.eval_every_steps": 0,
            "data.eval_path": "null",
        },
    )
    result = launch("single_gpu.yaml", overrides, num_processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    return output_dir / "final"


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 full shard, packed chat data, tensorboard tracker on."""
    return launched_run(
        tmp_path_factory, demo_assets, "fsdp2", "fsdp2_full_shard.yaml", **{"output.trackers": "[tensorboard]"}
    )


@pytest.fixture(scope="session")
def shard_grad_op_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 shard-grad-op with gradient accumulation."""
    return launched_run(
        tmp_path_factory, demo_assets, "sgo", "fsdp2_shard_grad_op.yaml", **{"train.gradient_accumulation_steps": 2}
    )


@pytest.fixture(scope="session")
def fsdp1_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP1 full shard on padded (not packed) batches."""
    return launched_run(tmp_path_factory, demo_assets, "fsdp1", "fsdp1_full_shard.yaml", **{"data.packing": "false"})


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """DDP with gradient accumulation (no_sync on all but the last micro-batch)."""
    return launched_run(tmp_path_factory, demo_assets, "ddp", "ddp.yaml", **{"train.gradient_accumulation_steps": 2})


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """The FSDP2 config on 1 process (a 1-rank group: SHARDED checkpoints), micro-batch 16: the same
    global batch of 16 rows as the 2-process runs of CHECKPOINT_SETTINGS."""
    return launched_run(
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
