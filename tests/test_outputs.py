"""Never lose work: output folders owned by one process, runs that cannot mix with earlier ones,
checkpoints damaged after their save passed over, exports that never touch their source."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers import DEMO_RECIPE

from finetune.config import load_recipe
from finetune.errors import FinetuneError
from finetune.export import consolidate as export_module
from finetune.export.consolidate import export_checkpoint
from finetune.run.build import preflight
from finetune.storage.checkpoint import MARKER, checkpoint_problem, complete_checkpoints, resolve_resume
from finetune.storage.outputs import claim_output_dir, export_lock, run_lock

pytestmark = pytest.mark.multiprocess  # the finished runs they damage come from real launches


def recipe_for(assets: Path, output_dir: Path, *overrides: str):
    base = [
        f"model.name_or_path={assets / 'base'}",
        f"data.train_path={assets / 'data' / 'train.jsonl'}",
        "data.eval_path=null",
        "eval.generate=null",  # the demo recipe's evaluation by generation needs eval data
        f"output.dir={output_dir}",
        "output.overwrite=false",
    ]
    return load_recipe(DEMO_RECIPE, base + list(overrides))


@pytest.fixture
def finished(one_process_run, tmp_path) -> Path:
    """A copy of a finished run: checkpoints step_6 and step_8, final/, metrics."""
    run = tmp_path / "run"
    shutil.copytree(one_process_run.output_dir, run)
    return run


def test_output_dir_must_be_a_folder_of_its_own(demo_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for where in (".", str(tmp_path.parent)):
        with pytest.raises(FinetuneError, match="is the current folder or one above it"):
            preflight(recipe_for(demo_assets, Path(where), "output.overwrite=true"))
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(FinetuneError, match="is a file; name a folder"):
        preflight(recipe_for(demo_assets, tmp_path / "taken"))
    unwritable = pytest.raises(FinetuneError, match=r"cannot write output.dir .* pick a folder you can write to")
    with unwritable, run_lock(tmp_path / "taken" / "run"):
        pass


def test_one_process_at_a_time_writes_a_folder(tmp_path, finished):
    """flock conflicts between two open files even within one process: the second holder is refused."""
    out = tmp_path / "new" / "run"
    busy = pytest.raises(FinetuneError, match=rf"output.dir {out} is in use by process {os.getpid()}")
    with run_lock(out), busy, run_lock(out):
        pass
    assert not (tmp_path / "new").exists()  # the folders made for the lock go with it
    export_out = tmp_path / "exported"
    with export_lock(export_out), pytest.raises(FinetuneError, match="export folder .* is in use by process"):
        export_checkpoint(finished, export_out)
    assert not export_out.exists() and not list(tmp_path.glob("*.partial"))
    with run_lock(out):  # released: taken again at once
        pass


def test_resume_never_moves_backwards_or_over_another_run(demo_assets, finished, tmp_path):
    with pytest.raises(FinetuneError, match=r"is at step 8, past train.max_steps=4; raise train.max_steps above 8"):
        preflight(recipe_for(demo_assets, finished, "checkpoint.resume=auto", "train.max_steps=4"))
    step_6 = finished / "checkpoints" / "step_6"
    with pytest.raises(FinetuneError, match=r"has checkpoints after step_6 \(step_8\), which resuming would replace"):
        preflight(recipe_for(demo_assets, finished, f"checkpoint.resume={step_6}", "train.max_steps=10"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FinetuneError, match="is not empty; choose another output.dir or pass output.overwrite=true"):
        preflight(recipe_for(demo_assets, other, f"checkpoint.resume={step_6}", "train.max_steps=10"))
    assert (other / "metrics.jsonl").read_text() == "{}\n"
    assert preflight(recipe_for(demo_assets, finished, "checkpoint.resume=auto", "train.max_steps=8")).name == "step_8"


def test_a_damaged_newest_checkpoint_is_passed_over_and_kept(finished, caplog):
    root = finished / "checkpoints"
    (root / "step_8" / "trainer_state.json").write_text("{")  # damaged after its save
    shutil.copytree(root / "step_6", root / "step_6.bak")  # a user's copy
    (root / "step_9.partial").mkdir()  # a save that never finished
    assert [p.name for p in complete_checkpoints(root)] == ["step_6", "step_8"]
    assert resolve_resume("auto", finished) == root / "step_6"
    assert "skipping damaged checkpoint" in caplog.text
    with pytest.raises(FinetuneError, match=r"step_8 is damaged \(trainer_state.json: "):
        resolve_resume(str(root / "step_8"), finished)
    claim_output_dir(finished, resumed_step=6)
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_6.bak", "step_8.damaged", "step_9.partial"]
    assert not (finished / "final").exists() and not (finished / "final_logits.safetensors").exists()
    assert max(json.loads(line)["step"] for line in (finished / "metrics.jsonl").read_text().splitlines()) == 6


def test_damaged_files_are_found_before_loading(finished, gpt2_full_one_process_run, tmp_path):
    step_8 = finished / "checkpoints" / "step_8"
    assert checkpoint_problem(step_8) is None
    metadata = step_8 / "pytorch_model_fsdp_0" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    assert checkpoint_problem(step_8).startswith("pytorch_model_fsdp_0/.metadata: ")
    full = tmp_path / "full"
    shutil.copytree(gpt2_full_one_process_run.output_dir / "checkpoints" / "step_4", full / "step_4")
    (model_file,) = (full / "step_4").glob("pytorch_model_fsdp*.bin")
    with model_file.open("r+b") as f:
        f.truncate(model_file.stat().st_size // 2)
    assert checkpoint_problem(full / "step_4").startswith(model_file.name)
    with pytest.raises(FinetuneError, match=rf"checkpoint {full / 'step_4'} is damaged \({model_file.name}"):
        export_checkpoint(full / "step_4", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_never_writes_onto_into_or_above_its_source(finished):
    checkpoint = finished / "checkpoints" / "step_8"
    before = sorted(str(p.relative_to(finished)) for p in finished.rglob("*"))
    for out, where in [(checkpoint, "is"), (checkpoint / "hf", "lies inside"), (finished, "holds")]:
        with pytest.raises(FinetuneError, match=f"{where} the checkpoint .* export to a folder outside it"):
            export_checkpoint(checkpoint, out, overwrite=True)
    with pytest.raises(FinetuneError, match="holds the checkpoint"):
        export_checkpoint(finished, finished.parent, overwrite=True)  # a run's folder, exported above itself
    assert sorted(str(p.relative_to(finished)) for p in finished.rglob("*")) == before
    assert (checkpoint / MARKER).exists()


def test_a_signal_during_export_says_how_to_finish(finished, tmp_path, monkeypatch):
    save_shard = export_module._save_shard

    def save_then_get_signalled(*args):
        save_shard(*args)
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, as a scheduler would send it

    monkeypatch.setattr(export_module, "_save_shard", save_then_get_signalled)
    out = tmp_path / "out"
    with pytest.raises(FinetuneError, match=r"stopped by SIGTERM .* finish with `finetune export .* --overwrite`"):
        export_checkpoint(finished, out)
    assert not out.exists() and not list(tmp_path.glob("out*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
