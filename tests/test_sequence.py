"""Sequence parallelism (`parallelism_config_sp_size`): rows split over groups of processes train exactly what one
process trains on whole rows.

The demo's packed rows hold about eight samples of 16 tokens in 128 positions, so at every split point of 2 or 4
slices a sample crosses from one process to the next; its tokens must still attend to each other, with global
positions. Each launched run trains 10 steps in fp32 and is compared with one process on the same global batch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import CONFIGS, REPO, LaunchedRun, launch, recipe_overrides
from safetensors.torch import load_file

from finetune.data.pack import collate_packed, collate_padded
from finetune.engine.attention import cumulative_lengths
from finetune.engine.sequence import launched_size, split_batch
from finetune.errors import FinetuneError

SP_CONFIG = "sequence_parallel.yaml"


def _packed_rows() -> dict[str, torch.Tensor]:
    rows = []
    for lengths in ([7, 5, 4], [9, 6]):
        ids, targets, positions = [], [], []
        for n in lengths:
            sample = list(range(3, 3 + n))
            ids += sample
            targets += sample[1:] + [-100]
            positions += list(range(n))
        padding = 17 - len(ids)
        rows.append({
            "input_ids": ids + [0] * padding, "target_ids": targets + [-100] * padding,
            "position_ids": positions + list(range(padding)), "num_tokens": len(ids),
        })  # fmt: skip
    return collate_packed(rows)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_slices_of_packed_rows_put_back_together_are_the_rows(size):
    batch = _packed_rows()
    parts = [split_batch(batch, size, rank) for rank in range(size)]
    whole = {key: torch.cat([p[key] for p in parts], dim=1) for key in ("input_ids", "target_ids", "position_ids")}
    length = batch["input_ids"].shape[1]
    for key in whole:  # the rows, then padding no target reads
        assert torch.equal(whole[key][:, :length], batch[key])
    assert (whole["target_ids"][:, length:] == -100).all()
    assert all(torch.equal(p["cu_seq_lens"], cumulative_lengths(whole["position_ids"])) for p in parts)
    assert sum(int(p["num_tokens"]) for p in parts) == int(batch["num_tokens"])
    kept = sum(p["kept_index"].numel() for p in parts)
    assert kept == batch["kept_index"].numel()
    assert all("attention_mask" not in p for p in parts)


def test_slices_of_padded_rows_carry_their_global_positions_and_mask():
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "target_ids": [6, 7, 8, 9, -100]},
        {"input_ids": [5, 6], "target_ids": [6, -100]},
    ]
    batch = collate_padded(rows, pad_id=0)
    first, second = split_batch(batch, 2, 0), split_batch(batch, 2, 1)
    assert first["position_ids"].tolist() == [[0, 1, 2]] * 2
    assert second["position_ids"].tolist() == [[3, 4, 5]] * 2  # one position of padding to divide by 2
    assert second["attention_mask"].tolist() == [[1, 1, 0], [0, 0, 0]]
    assert int(first["num_tokens"]) + int(second["num_tokens"]) == 7
    assert "cu_seq_lens" not in first


def _train(
    tmp_path_factory, assets, name, config, processes, micro_batch, *, sp=1, packing=True, **extra
) -> LaunchedRun:
    output_dir = tmp_path_factory.mktemp(name) / "out"
    overrides = recipe_overrides(
        assets, output_dir,
        **{
            "train.max_steps": 10, "train.micro_batch_size": micro_batch, "train.eval_every_steps": 5,
            "data.packing": str(packing).lower(), "optim.lr": "1e-3", "model.attn_implementation": "varlen",
            **extra,
        },
    )  # fmt: skip
    launch_args = ("--parallelism_config_sp_size", str(sp)) if sp > 1 else ()
    run = LaunchedRun(launch(config, overrides, num_processes=processes, launch_args=launch_args), output_dir)
    assert run.result.returncode == 0, run.result.stdout[-3000:] + run.result.stderr[-6000:]
    return run


def _weights(run: LaunchedRun) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


def _difference(a: LaunchedRun, b: LaunchedRun) -> float:
    first, second = _weights(a), _weights(b)
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


def _eval_losses(run: LaunchedRun) -> list[float]:
    return [m["eval_loss"] for m in run.metrics() if "eval_loss" in m]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, demo_assets) -> LaunchedRun:
    return _train(tmp_path_factory, demo_assets, "sp_reference", "single_gpu.yaml", 1, 8)


@pytest.fixture(scope="module")
def sp2(tmp_path_factory, demo_assets) -> LaunchedRun:
    """sp=2 on 2 processes, its layer inputs offloaded to host memory, checkpointing at step 5 for the resume
    below."""
    return _train(
        tmp_path_factory, demo_assets, "sp2", SP_CONFIG, 2, 8, sp=2,
        **{
            "checkpoint.save_every_steps": 5, "checkpoint.keep_last": 2,
            "train.activation_checkpointing": "full", "train.activation_offload": "true",
        },
    )  # fmt: skip


@pytest.mark.multiprocess
def test_sp2_trains_what_one_process_trains(one_process, sp2, demo_assets):
    assert "rows split over sequence groups of 2 (all-to-all attention)" in sp2.log
    assert "layer inputs kept in host memory until their backward" in sp2.log
    assert "sequence parallelism: each process holds 64 tokens of every row" in sp2.log
    assert "8 x 1 accumulation x 1 data-parallel processes = 8 sequences per step" in sp2.log
    assert _difference(sp2, one_process) <= 1e-5
    assert sp2.losses() == pytest.approx(one_process.losses(), rel=1e-5)
    assert _eval_losses(sp2) == pytest.approx(_eval_losses(one_process), rel=1e-5)
    # The slices' token counts add up to the rows': every target counted once.
    assert [m["target_tokens"] for m in sp2.metrics() if "loss" in m] == [
        m["target_tokens"] for m in one_process.metrics() if "loss" in m
    ]
    initial = load_file(demo_assets / "base" / "model.safetensors")
    trained = _weights(sp2)
    assert max((trained[k] - initial[k]).abs().max().item() for k in initial) > 1e-3  # not vacuous
    assert "Warning" not in sp2.result.stderr and "warn(" not in sp2.result.stderr


@pytest.mark.multiprocess
def test_sp2_by_dp2_on_4_processes_trains_what_one_process_trains(one_process, tmp_path_factory, demo_assets):
    run = _train(tmp_path_factory, demo_assets, "sp2dp2", SP_CONFIG, 4, 4, sp=2)
    assert "4 x 1 accumulation x 2 data-parallel processes = 8 sequences per step" in run.log
    assert _difference(run, one_process) <= 1e-5
    assert _eval_losses(run) == pytest.approx(_eval_losses(one_process), rel=1e-5)


@pytest.mark.multiprocess
def test_sp4_with_fewer_key_value_heads_than_processes_trains_what_one_process_trains(
    one_process, tmp_path_factory, demo_assets
):
    """4 query heads and 2 key/value heads over 4 processes: each query head takes its own key/value copy."""
    run = _train(tmp_path_factory, demo_assets, "sp4", SP_CONFIG, 4, 8, sp=4)
    assert "rows split over sequence groups of 4" in run.log
    assert _difference(run, one_process) <= 1e-5


@pytest.mark.multiprocess
def test_sp2_on_padded_rows_trains_what_one_process_trains(tmp_path_factory, demo_assets):
    one = _train(tmp_path_factory, demo_assets, "padded_reference", "single_gpu.yaml", 1, 8, packing=False)
    split = _train(tmp_path_factory, demo_assets, "padded_sp2", SP_CONFIG, 2, 8, sp=2, packing=False)
    assert _difference(split, one) <= 1e-5
    assert _eval_losses(split) == pytest.approx(_eval_losses(one), rel=1e-5)


@pytest.mark.multiprocess
def test_a_sequence_parallel_checkpoint_resumes_without_sequence_groups(
    one_process, sp2, tmp_path_factory, demo_assets
):
    """Elastic: sp=2's step-5 checkpoint goes on as plain FSDP2 over 2 processes (4 rows each) and ends where one
    process ends."""
    output_dir = tmp_path_factory.mktemp("sp_resumed") / "out"
    shutil.copytree(sp2.output_dir / "checkpoints" / "step_5", output_dir / "checkpoints" / "step_5")
    resumed = _train(
        tmp_path_factory, demo_assets, "unused", "fsdp2_full_shard.yaml", 2, 4,
        **{"checkpoint.resume": "auto", "output.overwrite": "false", "output.dir": output_dir},
    )  # fmt: skip
    assert f"resumed from {output_dir / 'checkpoints' / 'step_5'}" in resumed.log
    assert _difference(LaunchedRun(resumed.result, output_dir), one_process) <= 1e-5


def test_sequence_parallel_sizes_below_2_are_checked_first_and_1_is_none(tmp_path, monkeypatch):
    """sp_size 1 is no sequence parallelism (not a hybrid-sharding layout to refuse); 0, -2 or text are refused
    in one line, by check and by a launched run alike."""
    from finetune.engine.accelerator import mesh_sizes
    from finetune.engine.launch import read_launch

    config = yaml.safe_load((CONFIGS / SP_CONFIG).read_text())
    config["num_processes"] = 2
    for size in (1, 0, -2, "two"):
        config["parallelism_config"]["parallelism_config_sp_size"] = size
        path = tmp_path / f"sp_{size}.yaml"
        path.write_text(yaml.safe_dump(config))
        if size == 1:
            launch = read_launch(path, environ={})
            assert launch.sequence_parallel == 1 and launch.hybrid_shard_size is None
            continue
        with pytest.raises(FinetuneError, match=f"parallelism_config_sp_size: {size!r}; it is the number of"):
            read_launch(path, environ={})
    with pytest.raises(FinetuneError, match="parallelism_config_sp_size=0: it is the number of processes"):
        launched_size({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "0"})
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert mesh_sizes() is None and "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ


def test_check_refuses_what_sequence_groups_cannot_serve(tmp_path, demo_assets):
    """`finetune check`: sp under DDP, an sp that does not divide the processes or the heads, attention other than
    varlen: one line each, naming the fix, before anything starts."""

    def check(sp: int, processes: int, distributed: str = "FSDP", attention: str = "varlen", cp: int = 1) -> str:
        config = yaml.safe_load((CONFIGS / SP_CONFIG).read_text())
        config.update(num_processes=processes, distributed_type=distributed)
        config["parallelism_config"]["parallelism_config_sp_size"] = sp
        if cp > 1:
            config["parallelism_config"]["parallelism_config_cp_size"] = cp
        if distributed != "FSDP":
            config.pop("fsdp_config")
        path = tmp_path / f"sp{sp}_{processes}_{distributed}.yaml"
        path.write_text(yaml.safe_dump(config))
        result = subprocess.run(
            [sys.executable, "-m", "finetune", "check", str(REPO / "recipes/demo/tiny_llama.yaml"),
             f"model.name_or_path={demo_assets / 'base'}", f"model.attn_implementation={attention}",
             "--config", str(path)],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        assert "Traceback" not in result.stderr
        return result.stdout + result.stderr

    assert "model: " in check(2, 2)
    assert "shards the model with FSDP2, not distributed_type: MULTI_GPU" in check(2, 2, distributed="MULTI_GPU")
    assert "does not divide NUM_PROCESSES=3 into whole sequence groups" in check(2, 3)
    assert "which 3 does not divide; set parallelism_config_sp_size to a divisor of 4" in check(3, 3)
    assert "set model.attn_implementation: varlen (not sdpa)" in check(2, 2, attention="sdpa")
    assert "for long rows set parallelism_config_sp_size instead" in check(1, 2, cp=2)
