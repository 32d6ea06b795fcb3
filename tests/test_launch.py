"""Launch sizes are checked before anything starts: every problem at once, with its numbers and fix."""

from __future__ import annotations

import subprocess

import pytest
from helpers import CONFIGS, REPO

from finetune.engine.launch import read_launch
from finetune.errors import FinetuneError


def problems(config: str, processes: int, machines: int, **options) -> str:
    with pytest.raises(FinetuneError) as error:
        read_launch(CONFIGS / config, processes, machines, **{"environ": {}, **options})
    return str(error.value)


def test_multi_node_needs_the_rank_zero_address_and_whole_machines():
    message = problems("multi_node.yaml", 12, 5, machine_rank=5)
    assert "NUM_PROCESSES=12 is not a multiple of NUM_MACHINES=5" in message
    assert "MACHINE_RANK=5 must be between 0 and NUM_MACHINES-1=4" in message
    assert "NUM_MACHINES=5 needs MAIN_PROCESS_IP" in message


def test_machine_count_must_match_the_slurm_allocation():
    message = problems("multi_node.yaml", 16, 2, main_process_ip="10.0.0.1", environ={"SLURM_JOB_NUM_NODES": "4"})
    assert "NUM_MACHINES=2 but this SLURM job has 4 nodes" in message


def test_hybrid_shard_group_must_divide_the_processes():
    message = problems("hybrid_shard.yaml", 12, 1)
    assert "dp_shard_size=8 processes does not divide NUM_PROCESSES=12" in message and "12 / 8 = 1.5" in message
    launch = read_launch(CONFIGS / "hybrid_shard.yaml", 32, 4, main_process_ip="10.0.0.1", environ={})
    assert launch.shard_group == 8 and "4 replicas x 8-process shard groups" in launch.describe()


def test_planning_does_not_need_the_address():
    launch = read_launch(CONFIGS / "multi_node.yaml", for_launch=False)
    assert (launch.num_processes, launch.num_machines, launch.strategy) == (16, 2, "full_shard")
    assert launch.offload and launch.activation_checkpointing and launch.cpu_ram_efficient_loading


def test_make_train_stops_before_launching_a_multi_node_run_without_address():
    result = subprocess.run(
        ["make", "train-70b", "MACHINE_RANK=1"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "needs MAIN_PROCESS_IP" in result.stderr and "Traceback" not in result.stderr
    assert "accelerate launch" not in result.stdout  # make stopped at the check


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n",
            "sets fsdp_version: 3; FSDP comes in versions 1",
        ),
        (
            "distributed_type: NO\nnum_processes: 1\nnum_procesess: 2\n",
            r"accelerate launch would refuse .*num_procesess",
        ),
        ("model:\n  name_or_path: x\ndata: {}\n", "is not an accelerate config \\(no distributed_type\\)"),
        # one process: accelerate would start one and drop the others without a word
        ("distributed_type: 'NO'\nnum_processes: 2\n", "runs one process \\(distributed_type: NO\\), not NUM_PROC"),
    ],
)
def test_check_refuses_what_the_launcher_refuses(tmp_path, config, message):
    """A config that `check` approves and `accelerate launch` rejects sends a job to the queue for nothing."""
    path = tmp_path / "config.yaml"
    path.write_text(config)
    with pytest.raises(FinetuneError, match=message):
        read_launch(path, environ={})


def test_make_targets_pass_recipe_overrides():
    """`make train-tiny|check|plan ARGS=...` must hand ARGS to finetune, not run the defaults."""
    for target in ("train-tiny", "check", "plan"):
        result = subprocess.run(
            ["make", "-n", target, "ARGS=train.max_steps=7"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        command = next(line for line in result.stdout.splitlines() if "-m finetune" in line)
        assert "train.max_steps=7" in command, (target, command)
