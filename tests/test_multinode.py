"""Launching at scale, proven on one machine: two "machines" on the loopback address, hybrid
sharding over a real 2 x 2 mesh, rank-0 loading, and the launches that must be refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, DEMO_RECIPE, GPT2_WRAP, REPO, LaunchedRun, launch, recipe_overrides
from safetensors.torch import load_file
from test_export import max_logits_difference
from transformers import AutoModelForCausalLM

from finetune.engine.processes import free_port

pytestmark = pytest.mark.multiprocess


def run_machines(commands: list[list[str]], cwds: list[Path]) -> list[subprocess.CompletedProcess]:
    """Start one command per "machine" at once and wait for all of them."""
    processes = [
        subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
        for command, cwd in zip(commands, cwds, strict=True)
    ]  # fmt: skip
    results = []
    for command, process in zip(commands, processes, strict=True):
        try:
            stdout, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(other.pid, signal.SIGKILL)
            raise AssertionError(f"{' '.join(command)} did not finish in 300 s") from None
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return results


def machine_launch(rank: int, port: int, overrides: list[str]) -> list[str]:
    """`accelerate launch` for machine `rank` of 2, one process each, rank 0 at the loopback address."""
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / "fsdp2_full_shard.yaml"), "--mixed_precision", "no",
        "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(rank),
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
        "-m", "finetune", "train", str(DEMO_RECIPE), *overrides,
    ]  # fmt: skip


def test_two_machines_through_make_train_like_one(tmp_path, demo_assets, fsdp2_run):
    """`make train` on two machines (what the SLURM script runs on each node) trains, checkpoints and
    exports exactly what the 2-process single-machine run does."""
    out = tmp_path / "out"
    overrides = recipe_overrides(demo_assets, out, **{"output.trackers": "[tensorboard]"})
    port = free_port()
    commands = [
        ["make", "--no-print-directory", "train", f"RECIPE={DEMO_RECIPE.relative_to(REPO)}", "NUM_PROCESSES=2",
         "NUM_MACHINES=2", f"MACHINE_RANK={rank}", "MAIN_PROCESS_IP=127.0.0.1", f"MAIN_PROCESS_PORT={port}",
         "MIXED_PRECISION=no", f"ARGS={' '.join(overrides)}"]
        for rank in (0, 1)
    ]  # fmt: skip
    for result in run_machines(commands, [REPO, REPO]):
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run = LaunchedRun(commands, out)
    assert run.losses() == pytest.approx(fsdp2_run.losses(), abs=1e-6)
    assert [r["numel_local"] for r in run.rank_reports()] == [r["numel_local"] for r in fsdp2_run.rank_reports()]
    assert (out / "checkpoints" / "step_16" / "COMPLETE").exists()
    ours, theirs = (
        load_file(out / "final" / "model.safetensors"),
        load_file(fsdp2_run.output_dir / "final" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


def test_machines_that_do_not_share_output_dir_are_refused(tmp_path, demo_assets):
    """Machine 1 resolves output.dir to another folder (as on a node-local disk): refused before training."""
    overrides = recipe_overrides(demo_assets, Path("out"))
    cwds = [tmp_path / "machine0", tmp_path / "machine1"]
    for cwd in cwds:
        cwd.mkdir()
    port = free_port()
    results = run_machines([machine_launch(rank, port, overrides) for rank in (0, 1)], cwds)
    assert all(r.returncode != 0 for r in results)
    message = results[0].stderr
    assert (
        "is not the same folder on every machine: rank(s) 1" in message
        and "filesystem that all machines share" in message
    )
    assert not (cwds[0] / "out" / "checkpoints").exists() and not (cwds[0] / "out" / ".shared-check").exists()


def test_hybrid_sharding_on_a_2x2_mesh(tmp_path, demo_assets, fsdp2_run):
    """4 processes: 2 replicas x 2-process shard groups. Each rank holds half of every unit (also the
    final norm and head, after the last evaluation's forward); the rank holding the same half in the
    other replica holds the same values; the losses are the 2-process full-shard run's (same global
    batch of 16 rows)."""
    out = tmp_path / "out"
    overrides = recipe_overrides(demo_assets, out, **{"train.micro_batch_size": 4, "output.export": "false"})
    args = (
        "--num_machines",
        "1",
        "--parallelism_config_dp_shard_size",
        "2",
        "--fsdp_activation_checkpointing",
        "false",
    )
    result = launch("hybrid_shard.yaml", overrides, num_processes=4, launch_args=args)
    assert result.returncode == 0, result.stderr[-5000:]
    run = LaunchedRun(result, out)
    assert "hybrid: 2 replicas x 2-process shard groups" in run.log
    reports = run.rank_reports()
    units = [u for r in reports for u in r["units"] if u["numel_global"]]  # the root holds no parameter
    assert {u["class_name"] for u in units} == {"LlamaDecoderLayer", "Embedding", "LlamaRMSNorm", "Linear"}
    assert all(2 * u["numel_local"] == u["numel_global"] for u in units), units
    fingerprints = [r["params_fingerprint"] for r in reports]
    assert fingerprints[0] == fingerprints[2] and fingerprints[1] == fingerprints[3]
    assert fingerprints[0] != fingerprints[1]
    assert run.losses() == pytest.approx(fsdp2_run.losses(), abs=1e-5)


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        # FSDP1 on CPU would shard over 1 process and never reduce gradients across replicas.
        ("fsdp1_full_shard.yaml", ("--fsdp_sharding_strategy", "HYBRID_SHARD"), "shard groups of 1 process"),
        (
            "hybrid_shard.yaml",
            ("--num_machines", "1", "--parallelism_config_dp_shard_size", "3"),
            "does not tile the 2 launched processes",
        ),
    ],
    ids=["fsdp1-hybrid-1-process-groups", "shard-group-does-not-divide"],
)
def test_hybrid_launches_that_cannot_work_are_refused(tmp_path, demo_assets, config, args, message):
    result = launch(config, recipe_overrides(demo_assets, tmp_path / "out"), launch_args=args)
    assert result.returncode != 0 and message in result.stderr
    assert "[rank0]: Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_rank_zero_loading_starts_from_exactly_the_pretrained_weights(tmp_path, demo_assets):
    """The single-node preset (rank-0 loading, activation checkpointing): rank 1 starts on the meta
    device and receives rank 0's weights. One step at lr 1e-30 leaves every weight where it started."""
    out = tmp_path / "out"
    overrides = recipe_overrides(
        demo_assets, out, **{"train.max_steps": 1, "optim.lr": "1e-30", "optim.warmup_steps": 0}
    )
    result = launch("single_node.yaml", overrides)
    assert result.returncode == 0, result.stderr[-5000:]
    started_on_meta = [r["started_on_meta_device"] for r in LaunchedRun(result, out).rank_reports()]
    assert started_on_meta == [False, True]
    base = AutoModelForCausalLM.from_pretrained(demo_assets / "base").state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert base.keys() == trained.keys()
    assert max((base[k] - trained[k]).abs().max().item() for k in base) < 1e-20


def test_rank_zero_loading_keeps_tied_weights_tied(tmp_path, demo_assets, gpt2_base, gpt2_run):
    """The multi-node preset (rank-0 loading, CPU offload, activation checkpointing) on the tied GPT-2:
    it trains like the plain full-shard run, and the export (which stores the tied matrix once)
    reproduces the trained model's logits, which it could not if the two had drifted apart.

    GPT-2 trains with dropout: its recomputed layers must draw the forward's masks again, which
    accelerate's FSDP2 checkpointing does not do, so transformers' checkpointing stands in for it
    (with accelerate's, the losses part from the plain run's from the second step on)."""
    out = tmp_path / "out"
    overrides = recipe_overrides(demo_assets, out, **{"model.name_or_path": gpt2_base})
    result = launch("multi_node.yaml", overrides, launch_args=(*GPT2_WRAP, "--num_machines", "1"))
    assert result.returncode == 0, result.stderr[-5000:]
    assert "checkpointed by transformers, which replays the dropout masks" in result.stdout
    run = LaunchedRun(result, out)
    assert [r["started_on_meta_device"] for r in run.rank_reports()] == [False, True]
    assert run.losses() == pytest.approx(gpt2_run.losses(), abs=1e-5)
    assert max_logits_difference(out, out / "final") < 1e-5
    exported = AutoModelForCausalLM.from_pretrained(out / "final")
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()
    assert torch.isfinite(exported.lm_head.weight).all()
