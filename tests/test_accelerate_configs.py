"""Every accelerate config: readable by accelerate as-is, documented, and trained with for real.

fsdp2_full_shard, fsdp2_shard_grad_op, fsdp1_full_shard and ddp are trained in test_multiprocess;
the other two run here.
"""

from __future__ import annotations

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import CONFIGS, Run, launch, recipe_overrides

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
        "single_process",
    }
    assert expected <= names


@pytest.mark.multiprocess
def test_offload_config_trains_on_cpu(tmp_path, demo_assets):
    """CPU offload plus activation checkpointing from the accelerate config, on 2 processes."""
    run = Run(launch("fsdp2_offload.yaml", recipe_overrides(demo_assets, tmp_path / "out")), tmp_path / "out")
    assert run.result.returncode == 0, run.result.stderr[-4000:]
    assert "FSDP2 (reshard_after_forward=True, CPU offload) over 2 processes" in run.log
    assert "CheckpointWrapper" in run.log  # activation checkpointing was applied
    losses = run.losses()
    assert max(losses[-3:]) < 0.75 * losses[0]
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()


@pytest.mark.multiprocess
def test_single_process_config_trains(tmp_path, demo_assets):
    run = Run(
        launch("single_process.yaml", recipe_overrides(demo_assets, tmp_path / "out"), num_processes=1),
        tmp_path / "out",
    )
    assert run.result.returncode == 0, run.result.stderr[-4000:]
    assert "strategy: single process (no sharding)" in run.log
    (report,) = run.rank_reports()
    assert report["num_processes"] == 1 and report["numel_local"] == report["numel_global"]
    losses = run.losses()
    assert max(losses[-3:]) < 0.75 * losses[0]
