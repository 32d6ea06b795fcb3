"""Every accelerate config: readable by accelerate as-is, documented, and trained with for real.

fsdp2_full_shard, fsdp2_shard_grad_op, fsdp1_full_shard and ddp are trained in test_multiprocess;
the other two run here.
"""

from __future__ import annotations

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from helpers import CHECKPOINT_SETTINGS, CONFIGS, LaunchedRun, launch, recipe_overrides

CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))
FSDP1_VOCABULARY = (
    "fsdp_sharding_strategy",
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_limit_all_gathers",
    "fsdp_use_orig_params",
    "fsdp_sync_module_states",
)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_config_is_standard_accelerate_yaml_with_a_hardware_header(path):
    config = load_config_from_file(str(path))
    assert config.compute_environment.value == "LOCAL_MACHINE"
    header = path.read_text().split("compute_environment")[0]
    assert header.startswith("# ") and "Hardware:" in header
    if config.distributed_type.value == "FSDP":
        fsdp = config.fsdp_config
        assert fsdp["fsdp_state_dict_type"] in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
        assert fsdp["fsdp_auto_wrap_policy"] in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
        if fsdp["fsdp_version"] == 1:
            assert all(key in fsdp for key in FSDP1_VOCABULARY)
            assert "fsdp_reshard_after_forward" not in fsdp
        else:
            assert isinstance(fsdp["fsdp_reshard_after_forward"], bool)


def test_configs_cover_the_strategies():
    names = {p.stem for p in CONFIG_FILES}
    expected = {
        "fsdp2_full_shard",
        "fsdp2_shard_grad_op",
        "fsdp2_offload",
        "fsdp1_full_shard",
        "ddp",
        "single_gpu",
    }
    assert expected <= names


@pytest.mark.multiprocess
def test_offload_config_trains_on_cpu(tmp_path, demo_assets):
    """CPU offload plus activation checkpointing from the accelerate config, on 2 processes."""
    run = LaunchedRun(launch("fsdp2_offload.yaml", recipe_overrides(demo_assets, tmp_path / "out")), tmp_path / "out")
    assert run.result.returncode == 0, run.result.stderr[-4000:]
    assert "FSDP2 (reshard_after_forward=True, CPU offload) over 2 processes" in run.log
    assert "CheckpointWrapper" in run.log  # activation checkpointing was applied
    losses = run.losses()
    assert max(losses[-3:]) < 0.75 * losses[0]
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()


@pytest.mark.multiprocess
def test_single_gpu_config_trains_as_fsdp2_on_one_process_and_refuses_its_checkpoints(
    tmp_path, demo_assets, one_process_run
):
    """single_gpu.yaml trains a plain module (no FSDP): the same losses as FSDP2 on one process (fp32, 1e-6);
    each refuses to resume the other's checkpoints, naming the config that can, before anything is written."""
    from test_errors import assert_user_error

    settings = {**CHECKPOINT_SETTINGS, "train.micro_batch_size": 16}  # one_process_run's
    out = tmp_path / "out"
    run = LaunchedRun(launch("single_gpu.yaml", recipe_overrides(demo_assets, out, **settings), num_processes=1), out)
    assert run.result.returncode == 0, run.result.stderr[-4000:]
    assert "strategy: single process (no sharding)" in run.log
    (report,) = run.rank_reports()
    assert report["num_processes"] == 1 and report["numel_local"] == report["numel_global"]
    assert run.losses() == pytest.approx(one_process_run.losses(), abs=1e-6)
    more = {**settings, "train.max_steps": 10, "checkpoint.resume": "auto"}
    for config, source, fragment in [
        ("single_gpu.yaml", one_process_run.output_dir, "was written under FSDP, and this launch has no FSDP"),
        ("fsdp2_full_shard.yaml", out, "was written without FSDP (one process or DDP), and this launch shards"),
    ]:
        before = sorted(p.name for p in (source / "checkpoints").iterdir())
        assert_user_error(launch(config, recipe_overrides(demo_assets, source, **more), num_processes=1), fragment)
        assert sorted(p.name for p in (source / "checkpoints").iterdir()) == before


@pytest.mark.multiprocess
def test_single_gpu_config_launched_for_several_processes_is_refused_at_training(demo_assets, tmp_path):
    """accelerate's one-process launcher starts one process for --num_processes 2 and says nothing: training
    refuses it as `finetune check` does, before anything is written."""
    output_dir = tmp_path / "out"
    result = launch("single_gpu.yaml", recipe_overrides(demo_assets, output_dir), num_processes=2)
    assert result.returncode != 0
    assert "accelerate launch was asked for 2 processes, and single_gpu.yaml starts one" in result.stderr
    assert "finetune: error: accelerate launch was asked for 2" in result.stderr and not output_dir.exists()
