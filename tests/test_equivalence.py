"""Sharding changes where the bytes live, never what is learned.

The same global batch (8 rows a step, 10 steps, fp32) split as micro-batch x accumulation x processes
must give the same final weights on 1 process and on 2 under every strategy.
"""

from __future__ import annotations

import pytest
from helpers import LaunchedRun, launch, recipe_overrides
from safetensors.torch import load_file

pytestmark = pytest.mark.multiprocess

SPLITS = {
    # name: (accelerate config, processes, micro_batch_size, gradient_accumulation_steps)
    "fsdp2_4x1x2": ("fsdp2_full_shard.yaml", 2, 4, 1),
    "shard_grad_op_2x2x2": ("fsdp2_shard_grad_op.yaml", 2, 2, 2),
    "fsdp1_4x1x2": ("fsdp1_full_shard.yaml", 2, 4, 1),
    "ddp_2x2x2": ("ddp.yaml", 2, 2, 2),
    "single_4x2x1": ("single_gpu.yaml", 1, 4, 2),
}


def train_split(tmp_path_factory, assets, name, config, processes, micro_batch, accumulation, packing=True) -> dict:
    output_dir = tmp_path_factory.mktemp(name) / "out"
    overrides = recipe_overrides(
        assets,
        output_dir,
        **{
            "train.max_steps": 10,
            "train.micro_batch_size": micro_batch,
            "train.gradient_accumulation_steps": accumulation,
            "train.eval_every_steps": 0,
            "data.eval_path": "null",
            "data.packing": str(packing).lower(),
            "optim.lr": "1e-3",
        },
    )
    run = LaunchedRun(launch(config, overrides, num_processes=processes), output_dir)
    assert run.result.returncode == 0, run.result.stderr[-4000:]
    return load_file(output_dir / "final" / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_assets) -> dict:
    """One process, the whole global batch in one micro-batch."""
    return train_split(tmp_path_factory, demo_assets, "ref", "single_gpu.yaml", 1, 8, 1)


@pytest.mark.parametrize("name", SPLITS)
def test_split_matches_single_process(name, reference, tmp_path_factory, demo_assets):
    weights = train_split(tmp_path_factory, demo_assets, name, *SPLITS[name])
    difference = max_difference(weights, reference)
    print(f"{name}: max |w - w_ref| = {difference:.2e}")
    assert difference <= 1e-5
    # The comparison is not vacuous: training moved the weights far more than the tolerance.
    initial = load_file(demo_assets / "base" / "model.safetensors")
    assert max_difference(weights, initial) > 1e-3


def test_padded_batches_match_across_processes(tmp_path_factory, demo_assets):
    """Variable-length padded batches: per-token normalization must not depend on how rows are grouped."""
    single = train_split(tmp_path_factory, demo_assets, "pad1", "single_gpu.yaml", 1, 8, 1, packing=False)
    ddp = train_split(tmp_path_factory, demo_assets, "pad2", "ddp.yaml", 2, 2, 2, packing=False)
    difference = max_difference(single, ddp)
    print(f"padded 8x1x1 vs ddp 2x2x2: max |w - w_ref| = {difference:.2e}")
    assert difference <= 1e-5
