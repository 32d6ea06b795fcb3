"""User errors: exit status 2, one line naming the fix, no traceback, nothing written or lost."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DEMO_RECIPE, REPO, launch, recipe_overrides


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m finetune ...` as one process, without a launcher."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def assert_user_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("finetune: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert fragment in errors[0]
    # Only the launcher may print a traceback (of its own); none comes from a finetune process.
    assert "finetune/" not in result.stderr and "[rank0]: Traceback" not in result.stderr


def test_recipe_typo_fails_fast_without_traceback():
    result = run_cli("train", str(DEMO_RECIPE), "optim.lrr=1e-3", "train.max_step=3")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "unknown key optim.lrr; did you mean optim.lr?" in result.stderr
    assert "unknown key train.max_step; did you mean train.max_steps?" in result.stderr


def test_missing_column_keeps_the_output_dir_untouched(tmp_path, demo_assets):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "keep.txt").write_text("earlier results")
    overrides = recipe_overrides(demo_assets, output_dir, **{"data.train_path": data, "output.overwrite": "true"})
    result = run_cli("train", str(DEMO_RECIPE), *overrides)
    assert result.returncode == 2
    assert_user_error(result, "dataset has columns ['question', 'answer'], expected messages")
    assert [p.name for p in output_dir.iterdir()] == ["keep.txt"]


def test_non_empty_output_dir_is_refused(tmp_path, demo_assets):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "metrics.jsonl").write_text("{}\n")
    overrides = recipe_overrides(demo_assets, output_dir, **{"output.overwrite": "false"})
    result = run_cli("train", str(DEMO_RECIPE), *overrides)
    assert result.returncode == 2
    assert_user_error(result, "is not empty; choose another output.dir or pass output.overwrite=true")
    assert (output_dir / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.multiprocess
def test_a_fresh_run_that_fails_leaves_no_earlier_results_beside_its_recipe(tmp_path, demo_assets, fsdp2_run):
    """Overwriting a finished run, then diverging: the folder must not look like a finished run of the new recipe."""
    output_dir = tmp_path / "out"
    shutil.copytree(fsdp2_run.output_dir, output_dir)
    overrides = recipe_overrides(
        demo_assets, output_dir,
        **{"optim.lr": "1e12", "optim.max_grad_norm": 0, "optim.warmup_steps": 0, "output.overwrite": "true"},
    )  # fmt: skip
    result = run_cli("train", str(DEMO_RECIPE), *overrides)
    assert result.returncode == 2
    assert_user_error(result, "training diverged before this update was applied")
    assert "finetune: error: step " in result.stderr
    assert "lr: 1000000000000.0" in (output_dir / "recipe.yaml").read_text()
    left = {p.name for p in output_dir.iterdir()}
    assert not left & {"final", "final_logits.safetensors", "checkpoints", "finetune", ".finetune.lock"}, left
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"metrics.jsonl holds {name}, which is not JSON"))


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, demo_assets):
    import os

    from finetune.storage.outputs import run_lock

    output_dir = tmp_path / "out"
    with run_lock(output_dir):  # as a running training's main process holds it
        result = run_cli("train", str(DEMO_RECIPE), *recipe_overrides(demo_assets, output_dir))
    assert_user_error(result, f"output.dir {output_dir} is in use by process {os.getpid()}")
    assert not output_dir.exists()


def test_metrics_are_strict_json():
    from finetune.run.metrics import json_line

    assert json_line({"step": 3, "loss": float("inf"), "grad_norm": float("nan"), "lr": 1e-3}) == (
        '{"step": 3, "loss": null, "grad_norm": null, "lr": 0.001}'
    )


@pytest.mark.multiprocess
def test_a_data_error_under_two_processes_is_one_line(tmp_path, demo_assets):
    """Rank 0 finds the bad sample; rank 1 must stop with it, not with a gloo traceback through our frames."""
    data = tmp_path / "chat.jsonl"
    good = (demo_assets / "data" / "train.jsonl").read_text().splitlines()[:20]
    reply = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    data.write_text("\n".join(good) + "\n" + json.dumps({"messages": reply}) + "\n")
    data.write_text(data.read_text() + json.dumps({"messages": [{"role": "assistant"}]}) + "\n")
    output_dir = tmp_path / "out"
    result = launch("fsdp2_full_shard.yaml", recipe_overrides(demo_assets, output_dir, **{"data.train_path": data}))
    assert_user_error(result, "sample 21, message 0 (assistant) has no content")
    assert not output_dir.exists()


def test_damaged_model_weights_are_a_user_error(tmp_path, demo_assets):
    from finetune.config import ModelConfig
    from finetune.errors import FinetuneError
    from finetune.model.loading import check_max_length, load_model

    model = tmp_path / "model"
    shutil.copytree(demo_assets / "base", model)
    with (model / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(FinetuneError, match=f"cannot load a causal LM from '{model}' \\(Error while deserializing"):
        load_model(ModelConfig(name_or_path=str(model)), activation_checkpointing="none")
    with pytest.raises(
        FinetuneError, match="data.max_length=4096 exceeds the 256 positions of .*; set data.max_length"
    ):
        check_max_length(ModelConfig(name_or_path=str(model)), 4096)


@pytest.mark.multiprocess
def test_unknown_wrap_class_through_the_launcher(tmp_path, demo_assets):
    output_dir = tmp_path / "out"
    result = launch(
        "fsdp2_full_shard.yaml",
        recipe_overrides(demo_assets, output_dir),
        launch_args=("--fsdp_transformer_layer_cls_to_wrap", "GPT2Block"),
    )
    assert_user_error(
        result, "names GPT2Block, which LlamaForCausalLM does not contain; use one of: LlamaDecoderLayer"
    )
    assert not output_dir.exists()


@pytest.mark.multiprocess
def test_activation_checkpointing_in_both_places(tmp_path, demo_assets):
    result = launch(
        "fsdp2_full_shard.yaml",
        recipe_overrides(demo_assets, tmp_path / "out", **{"train.activation_checkpointing": "true"}),
        launch_args=("--fsdp_activation_checkpointing", "true"),
    )
    assert_user_error(result, "activation checkpointing is enabled both in the recipe")


def test_missing_model_folder_is_named(tmp_path, demo_assets):
    overrides = recipe_overrides(demo_assets, tmp_path / "out", **{"model.name_or_path": tmp_path / "no_model"})
    result = run_cli("train", str(DEMO_RECIPE), *overrides)
    assert result.returncode == 2
    assert_user_error(result, f"model.name_or_path {tmp_path / 'no_model'} is not a folder")


def test_resume_auto_without_a_checkpoint_keeps_earlier_results(tmp_path, demo_assets):
    """resume=auto that finds nothing to resume is a fresh start, and needs output.overwrite like one."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "metrics.jsonl").write_text("{}\n")
    overrides = recipe_overrides(demo_assets, output_dir, **{"output.overwrite": "false", "checkpoint.resume": "auto"})
    result = run_cli("train", str(DEMO_RECIPE), *overrides)
    assert result.returncode == 2
    assert_user_error(result, "is not empty; choose another output.dir or pass output.overwrite=true")
    assert (output_dir / "metrics.jsonl").read_text() == "{}\n"


def test_export_bad_input_names_the_fix_and_writes_nothing(fsdp2_run, tmp_path):
    checkpoint = fsdp2_run.output_dir / "checkpoints" / "step_16"
    out = tmp_path / "out"
    assert_user_error(run_cli("export", str(tmp_path / "missing"), str(out)), "does not exist")
    (tmp_path / "step_3").mkdir()
    assert_user_error(run_cli("export", str(tmp_path / "step_3"), str(out)), "is not a complete checkpoint")
    assert_user_error(run_cli("export", str(tmp_path), str(out)), "is not a complete checkpoint")
    unsaved = tmp_path / "unsaved_run"  # a run's output dir without a checkpoint
    unsaved.mkdir()
    shutil.copy(fsdp2_run.output_dir / "recipe.yaml", unsaved)
    assert_user_error(run_cli("export", str(unsaved), str(out)), "is the output dir of a run that saved no checkpoint")
    without_files = tmp_path / "step_16"  # a checkpoint copied without its hf/ folder
    shutil.copytree(checkpoint, without_files, ignore=lambda folder, names: ["hf"] if "hf" in names else [])
    assert_user_error(run_cli("export", str(without_files), str(out)), "has no hf/config.json")
    result = run_cli("export", str(checkpoint), str(out), "--max-shard-size", "5XB")
    assert_user_error(result, "max shard size '5XB' is not a size; write it like 5GB")
    result = run_cli("export", str(checkpoint), str(out), "--dtype", "bf61")
    assert result.returncode == 2 and "invalid choice: 'bf61'" in result.stderr
    assert_user_error(run_cli("export", str(checkpoint), "/proc/finetune_out"), "pick a folder you can write to")
    assert not out.exists() and not list(tmp_path.glob("*.partial"))

    existing = tmp_path / "existing"
    shutil.copytree(fsdp2_run.output_dir / "final", existing)
    before = {p.name: p.stat().st_mtime_ns for p in existing.iterdir()}
    assert_user_error(run_cli("export", str(checkpoint), str(existing)), "already holds a model; pass --overwrite")
    assert {p.name: p.stat().st_mtime_ns for p in existing.iterdir()} == before
    assert run_cli("export", str(checkpoint), str(existing), "--overwrite").returncode == 0


def test_export_of_a_damaged_checkpoint_leaves_no_folder(fsdp2_run, tmp_path):
    damaged = tmp_path / "step_16"
    shutil.copytree(fsdp2_run.output_dir / "checkpoints" / "step_16", damaged)
    (damaged / "pytorch_model_fsdp_0" / "__1_0.distcp").write_bytes(b"")  # rank 1's shard lost
    out = tmp_path / "out"
    assert_user_error(run_cli("export", str(damaged), str(out)), "pytorch_model_fsdp_0/__1_0.distcp is 0 bytes of")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_gated_model_without_a_login_is_one_line_naming_the_fix(monkeypatch):
    """The hub's refusal of a gated model (meta-llama, Mistral) becomes one line: the licence page and the login."""
    from transformers import AutoTokenizer

    from finetune.config import ModelConfig
    from finetune.errors import FinetuneError
    from finetune.model.loading import load_tokenizer

    def refuse(*args, **kwargs):
        raise OSError(
            "You are trying to access a gated repo.\nMake sure to have access to it at "
            "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct.\n401 Client Error."
        )

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(FinetuneError) as info:
        load_tokenizer(ModelConfig(name_or_path="meta-llama/Llama-3.1-8B-Instruct"))
    message = str(info.value)
    assert "\n" not in message and "huggingface-cli login" in message
    assert "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct" in message and "gated" in message


def _copy_of_base(demo_assets, folder: Path) -> Path:
    shutil.copytree(demo_assets / "base", folder)
    return folder


def test_vocabulary_mismatches_are_one_line_before_any_weight_loads(tmp_path, demo_assets):
    """A tokenizer past the embedding, and a reference model of another vocabulary or tokenizer than the
    policy's, are refused naming both sizes (or the first token that differs), not met in the forward."""
    from transformers import AutoTokenizer

    grown = _copy_of_base(demo_assets, tmp_path / "grown")
    tokenizer = AutoTokenizer.from_pretrained(grown)
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save_pretrained(grown)
    overrides = recipe_overrides(demo_assets, tmp_path / "out", **{"model.name_or_path": grown})
    assert_user_error(run_cli("train", str(DEMO_RECIPE), *overrides), "has 279 tokens, more than the 278 rows")

    wider = _copy_of_base(demo_assets, tmp_path / "wider")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": 320}))
    renumbered = _copy_of_base(demo_assets, tmp_path / "renumbered")
    vocabulary = json.loads((renumbered / "tokenizer.json").read_text())
    tokens = vocabulary["model"]["vocab"]
    tokens["1"], tokens["2"] = tokens["2"], tokens["1"]
    (renumbered / "tokenizer.json").write_text(json.dumps(vocabulary))
    pairs = {
        "data.train_path": demo_assets / "data" / "pairs_train.jsonl", "data.eval_path": "null",
        "data.format": "auto", "preference.loss": "dpo", "preference.reference": "model",
    }  # fmt: skip
    for reference, message in (
        (wider, f"preference.reference_model '{wider}' has 320 embedding rows and the model"),
        (
            renumbered,
            f"the tokenizer of preference.reference_model '{renumbered}' differs from the model's (278 and "
            "278 tokens; first difference: '",
        ),
    ):
        settings = {**pairs, "preference.reference_model": reference}
        overrides = recipe_overrides(demo_assets, tmp_path / "out", **settings)
        assert_user_error(run_cli("train", str(DEMO_RECIPE), *overrides), message)
    # A distillation teacher, the same: named by its own setting.
    overrides = recipe_overrides(demo_assets, tmp_path / "out", **{"distill.teacher": renumbered})
    message = f"the tokenizer of distill.teacher '{renumbered}'"
    assert_user_error(run_cli("train", str(DEMO_RECIPE), *overrides), message)
    assert not (tmp_path / "out").exists()


def test_the_last_messages_of_the_second_pass_name_the_key_the_user_set(tmp_path, demo_assets):
    """Each error names the setting that causes it: a mixture source by its place in data.train, the share
    data.eval_fraction held out, a fraction that rounds a source to nothing, an unknown attention kernel."""
    few = tmp_path / "three.jsonl"
    few.write_text("".join((demo_assets / "data" / "train.jsonl").read_text().splitlines(keepends=True)[:3]))
    train = demo_assets / "data" / "train.jsonl"
    for settings, message in (
        ({"data.train": f"[{{path: {train}}}, {{path: {tmp_path / 'nope.jsonl'}}}]"},
         "data.train[1].path"),
        ({"data.train": f"[{{path: {train}}}, {{path: {few}, split: validation}}]"},
         "data.train[1].split='validation' has no effect on local data"),
        ({"data.train": f"[{{path: {train}}}, {{path: {few}, fraction: 0.1}}]"},
         "fraction=0.1 of its 3 samples rounds to none"),
        ({"data.eval_path": "null", "data.eval_fraction": 0.999}, "data.eval_fraction=0.999 held out that share"),
        ({"model.attn_implementation": "flashy"}, "model.attn_implementation=flashy is no attention implementation"),
    ):  # fmt: skip
        train_key = {"data.train_path": "null"} if "data.train" in settings else {}
        overrides = recipe_overrides(demo_assets, tmp_path / "out", **train_key, **settings)
        assert_user_error(run_cli("train", str(DEMO_RECIPE), *overrides), message)
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_an_fsdp_version_accelerate_lacks_is_one_line(tmp_path, demo_assets):
    config = tmp_path / "fsdp3.yaml"
    config.write_text((REPO / "accelerate_configs" / "fsdp2_full_shard.yaml").read_text().replace(
        "fsdp_version: 2", "fsdp_version: 3"))  # fmt: skip
    result = launch(str(config), recipe_overrides(demo_assets, tmp_path / "out"), num_processes=1)
    assert_user_error(result, "the accelerate config says fsdp_version: 3; accelerate has FSDP 1 and 2")
