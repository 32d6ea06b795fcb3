"""Checkpoints: atomic and pruned, exact resume on the same and on another process count, preemption."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CHECKPOINT_SETTINGS,
    CONFIGS,
    DEMO_RECIPE,
    REPO,
    LaunchedRun,
    launch,
    recipe_overrides,
    signal_launch,
)
from safetensors.torch import load_file

from finetune.config import load_recipe, save_recipe
from finetune.errors import FinetuneError
from finetune.storage.checkpoint import MARKER, TrainingState, load_checkpoint, recipe_changes, resolve_resume

pytestmark = pytest.mark.multiprocess

SETTINGS = CHECKPOINT_SETTINGS


def run_with(assets, output_dir, processes=2, config="fsdp2_full_shard.yaml", **extra) -> LaunchedRun:
    result = launch(config, recipe_overrides(assets, output_dir, **{**SETTINGS, **extra}), num_processes=processes)
    assert result.returncode == 0, result.stderr[-4000:]
    return LaunchedRun(result, output_dir)


def losses_by_step(run: LaunchedRun) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in run.metrics() if "loss" in m}


def max_weight_difference(a: LaunchedRun, b: LaunchedRun) -> float:
    wa, wb = (load_file(r.output_dir / "final" / "model.safetensors") for r in (a, b))
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_assets) -> LaunchedRun:
    return run_with(demo_assets, tmp_path_factory.mktemp("full") / "out")


def resume_from_step_6(run: LaunchedRun, tmp_path) -> Path:
    """A new output dir holding only the step 6 checkpoint of `run`, plus an incomplete step 7 (a save that died)."""
    output_dir = tmp_path / "out"
    shutil.copytree(run.output_dir / "checkpoints" / "step_6", output_dir / "checkpoints" / "step_6")
    (output_dir / "checkpoints" / "step_7").mkdir()
    return output_dir


def test_checkpoints_are_complete_and_pruned(uninterrupted):
    root = uninterrupted.output_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_8"]  # keep_last=2
    for checkpoint in root.iterdir():
        assert (checkpoint / MARKER).exists()
        assert (checkpoint / "pytorch_model_fsdp_0").is_dir()  # SHARDED: torch.distributed.checkpoint shards
        assert list((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
    state = json.loads((root / "step_6" / "trainer_state.json").read_text())
    assert state == {**state, "step": 6, "epoch": 0, "rows_into_epoch": 96, "num_processes": 2}
    # Security: weights in DCP/safetensors files, the LR schedule in JSON; no pickle that accelerate
    # would load with weights_only=False (its custom-object checkpoints) is ever written.
    assert state["scheduler"]["last_epoch"] == 6
    assert not list((root / "step_6").glob("custom_checkpoint_*"))
    assert (root / "step_6" / "hf" / "config.json").exists() and (root / "step_6" / "hf" / "tokenizer.json").exists()


def test_exact_resume_skips_incomplete_checkpoints(uninterrupted, demo_assets, tmp_path):
    resumed = run_with(demo_assets, resume_from_step_6(uninterrupted, tmp_path), **{"checkpoint.resume": "auto"})
    assert "ignoring incomplete checkpoint" in resumed.log and "step_7" in resumed.log
    assert "resumed from" in resumed.log and "step_6" in resumed.log
    assert "settings changed" not in resumed.log  # the same recipe, copied to another output dir
    full, again = losses_by_step(uninterrupted), losses_by_step(resumed)
    assert sorted(again) == [7, 8]
    for step in (7, 8):
        assert again[step] == pytest.approx(full[step], abs=1e-6)
    assert max_weight_difference(uninterrupted, resumed) <= 1e-6


def test_resume_on_one_process(uninterrupted, demo_assets, tmp_path):
    """Saved by 2 processes, resumed by 1 with the same global batch: no sample skipped or repeated."""
    output_dir = resume_from_step_6(uninterrupted, tmp_path)
    resumed = run_with(
        demo_assets, output_dir, processes=1, **{"checkpoint.resume": "auto", "train.micro_batch_size": 16}
    )
    full, again = losses_by_step(uninterrupted), losses_by_step(resumed)
    for step in (7, 8):
        assert again[step] == pytest.approx(full[step], abs=1e-5)
    assert max_weight_difference(uninterrupted, resumed) <= 1e-5


def test_resume_on_two_processes(one_process_run, uninterrupted, demo_assets, tmp_path):
    """Saved by 1 process (micro-batch 16), resumed by 2 (micro-batch 8): the same global order continues."""
    resumed = run_with(demo_assets, resume_from_step_6(one_process_run, tmp_path), **{"checkpoint.resume": "auto"})
    full, again = losses_by_step(uninterrupted), losses_by_step(resumed)
    assert losses_by_step(one_process_run)[6] == pytest.approx(full[6], abs=1e-5)
    for step in (7, 8):
        assert again[step] == pytest.approx(full[step], abs=1e-5)
    assert max_weight_difference(uninterrupted, resumed) <= 1e-5


def test_asynchronous_saves_write_the_same_checkpoints_and_resume_exactly(uninterrupted, demo_assets, tmp_path):
    """checkpoint.async_save: DCP writes in the background; the checkpoints have the synchronous ones' folders,
    marker and pruning, and step 6 resumes to the uninterrupted run's losses and weights (the state was
    copied to host memory before training changed it)."""
    async_run = run_with(demo_assets, tmp_path / "async", **{"checkpoint.async_save": "true"})
    assert losses_by_step(async_run) == losses_by_step(uninterrupted)
    root, reference = async_run.output_dir / "checkpoints", uninterrupted.output_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_8"]
    for step in ("step_6", "step_8"):
        assert (root / step / MARKER).exists()
        assert sorted(p.name for p in (root / step).iterdir()) == sorted(p.name for p in (reference / step).iterdir())
    assert all(m["checkpoint_seconds"] >= 0 for m in async_run.metrics() if "checkpoint_seconds" in m)
    resumed = run_with(demo_assets, resume_from_step_6(async_run, tmp_path), **{"checkpoint.resume": "auto"})
    full, again = losses_by_step(uninterrupted), losses_by_step(resumed)
    for step in (7, 8):
        assert again[step] == pytest.approx(full[step], abs=1e-6)
    assert max_weight_difference(uninterrupted, resumed) <= 1e-6


def test_asynchronous_saves_need_sharded_fsdp2():
    from types import SimpleNamespace

    from finetune.storage.checkpoint import async_saver

    ddp = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None))
    with pytest.raises(FinetuneError, match="checkpoint.async_save needs full fine-tuning under FSDP2 with"):
        async_saver(ddp, None, None)


def test_full_state_dict_checkpoint_resumes_on_one_process(uninterrupted, demo_assets, tmp_path_factory):
    """FULL checkpoints (the shard-grad-op config) saved by 2 processes resume on 1."""
    config = "fsdp2_shard_grad_op.yaml"
    full = run_with(demo_assets, tmp_path_factory.mktemp("full_sd") / "out", config=config)
    assert (full.output_dir / "checkpoints" / "step_6" / "pytorch_model_fsdp.bin").is_file()
    resumed = run_with(
        demo_assets,
        resume_from_step_6(full, tmp_path_factory.mktemp("full_sd_resumed")),
        processes=1,
        config=config,
        **{"checkpoint.resume": "auto", "train.micro_batch_size": 16},
    )
    before, again = losses_by_step(full), losses_by_step(resumed)
    for step in (7, 8):
        assert again[step] == pytest.approx(before[step], abs=1e-5)
    assert max_weight_difference(full, resumed) <= 1e-5
    assert max_weight_difference(full, uninterrupted) <= 1e-5  # FULL and SHARDED runs train the same model


def start_long_run(assets: Path, output_dir: Path, save_every: int, stdout: int) -> subprocess.Popen:
    """A 2000-step, 2-process run started in the background, to be signalled by the test."""
    overrides = recipe_overrides(
        assets, output_dir, **{**SETTINGS, "train.max_steps": 2000, "checkpoint.save_every_steps": save_every}
    )
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp2_full_shard.yaml"),
        "--num_processes", "2", "--mixed_precision", "no", "-m", "finetune", "train", str(DEMO_RECIPE), *overrides,
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=subprocess.STDOUT, text=True)


def wait_until_dead(pid: int) -> None:
    """A SIGKILLed process is gone (or a zombie) within moments; it can then write nothing more."""
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} survived SIGKILL")


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(demo_assets, tmp_path):
    """Kill every process with SIGKILL while a checkpoint is being written: the previous one stays
    complete and is the one `resume=auto` picks; the resumed run then finishes."""
    output_dir = tmp_path / "out"
    process = start_long_run(demo_assets, output_dir, save_every=1, stdout=subprocess.DEVNULL)
    root = output_dir / "checkpoints"
    deadline = time.time() + 120
    # Freeze every process the moment a save is in progress (after one completed checkpoint); if the
    # save is still unfinished once they are stopped, kill them, else let them go on to the next save.
    while time.time() < deadline:
        if list(root.glob("step_*/COMPLETE")) and list(root.glob("*.partial")):
            signal_launch(process.pid, signal.SIGSTOP)
            if list(root.glob("*.partial")):
                break
            signal_launch(process.pid, signal.SIGCONT)
        time.sleep(0.002)
    workers = signal_launch(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert len(workers) == 2
    for pid in workers:
        wait_until_dead(pid)
    assert list(root.glob("*.partial")), "no save was caught in progress"
    latest = max(root.glob("step_*/COMPLETE"), key=lambda p: int(p.parent.name.removeprefix("step_"))).parent
    assert resolve_resume("auto", output_dir) == latest
    step = int(latest.name.removeprefix("step_"))
    resumed = run_with(demo_assets, output_dir, **{"checkpoint.resume": "auto", "train.max_steps": step + 2})
    assert f"resumed from {latest}, with settings changed since it was saved: " in resumed.log
    assert f"train.max_steps: 2000 -> {step + 2}" in resumed.log
    assert not list(root.glob("*.partial")) and (output_dir / "final" / "model.safetensors").exists()


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(demo_assets, tmp_path):
    output_dir = tmp_path / "out"
    process = start_long_run(demo_assets, output_dir, save_every=1000, stdout=subprocess.PIPE)
    metrics = output_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    # SIGTERM twice, as schedulers repeat it, to one of the two training processes only: the other, never
    # signalled, must stop and save at the same step (the flag is summed over processes with the step's loss).
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    for _ in range(2):
        subprocess.run(["kill", "-TERM", workers[0]])
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert "preempted: checkpoint saved at step" in output
    (checkpoint,) = (output_dir / "checkpoints").iterdir()
    state = TrainingState(**json.loads((checkpoint / "trainer_state.json").read_text()))
    assert 3 <= state.step < 2000 and (checkpoint / MARKER).exists()
    assert resolve_resume("auto", output_dir) == checkpoint
    assert not (output_dir / "final").exists()


def test_resume_errors_name_the_fix(tmp_path, uninterrupted):
    with pytest.raises(FinetuneError, match="does not exist; pass checkpoint.resume=auto"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "step_3").mkdir()
    with pytest.raises(FinetuneError, match=r"is incomplete \(no COMPLETE marker\)"):
        resolve_resume(str(tmp_path / "step_3"), tmp_path)
    assert resolve_resume("auto", tmp_path / "empty") is None  # nothing to resume: start fresh
    other_model = load_recipe(DEMO_RECIPE, ["model.name_or_path=another/model"])
    with pytest.raises(FinetuneError, match="was trained from .* but the recipe names 'another/model'"):
        load_checkpoint(uninterrupted.output_dir / "checkpoints" / "step_6", other_model, load_state=None)


def test_a_resume_names_every_setting_it_changes(tmp_path):
    """A resume trains on with the recipe it is given; the log says what differs from the checkpoint's recipe
    (a preference loss or beta changed mid-run included), and nothing when only the output dir moved."""
    pairs = ["data.format=auto", "preference.loss=dpo", "preference.beta=0.1"]
    save_recipe(load_recipe(DEMO_RECIPE, pairs), tmp_path / "recipe.yaml")
    now = ["preference.loss=ipo", "preference.beta=0.5", "optim.lr=1e-4", f"output.dir={tmp_path}"]
    changed = load_recipe(DEMO_RECIPE, ["data.format=auto", *now, "checkpoint.resume=auto"])
    assert recipe_changes(tmp_path, changed) == [
        "optim.lr: 0.003 -> 0.0001", "preference.beta: 0.1 -> 0.5", "preference.loss: dpo -> ipo",
    ]  # fmt: skip
    assert recipe_changes(tmp_path, load_recipe(DEMO_RECIPE, [*pairs, f"output.dir={tmp_path}"])) == []


# Written by finetune at 82a1676, before the package was grouped into layers (tests/fixtures/checkpoint_82a1676/
# README.md): a tiny Llama, 64 lists, and step 2 of a full and a LoRA run on 1 process, with the losses those runs
# logged at steps 3 and 4 when they went on.
OLD_CHECKPOINTS = REPO / "tests" / "fixtures" / "checkpoint_82a1676"


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_checkpoint_written_before_the_layout_change_resumes_exactly(tmp_path, kind):
    checkpoint = tmp_path / "step_2"
    shutil.copytree(OLD_CHECKPOINTS / kind / "step_2", checkpoint)
    output_dir = tmp_path / "out"
    adapters = ["peft.r=4", "peft.target_modules=[q_proj,v_proj]"] if kind == "lora" else []
    overrides = [
        f"model.name_or_path={OLD_CHECKPOINTS.relative_to(REPO) / 'base'}",  # as the checkpoint names it
        f"data.train_path={OLD_CHECKPOINTS / 'data' / 'train.jsonl'}",
        "data.eval_path=null", f"output.dir={output_dir}", "output.trackers=[]", "train.max_steps=4",
        "train.log_every_steps=1", "train.eval_every_steps=0", "train.micro_batch_size=4",
        "train.global_batch_size=null", "data.max_length=64", "eval.generate=null", "checkpoint.save_every_steps=2",
        "optim.warmup_steps=1", "output.export=false", f"checkpoint.resume={checkpoint}", *adapters,
    ]  # fmt: skip
    result = launch("fsdp2_full_shard.yaml", overrides, num_processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = {str(m["step"]): m["loss"] for m in LaunchedRun(result, output_dir).metrics() if "loss" in m}
    expected = json.loads((OLD_CHECKPOINTS / kind / "losses_after_step_2.json").read_text())
    assert losses.keys() == expected.keys(), "the run did not resume at step 2"
    assert losses == pytest.approx(expected, rel=1e-6)
