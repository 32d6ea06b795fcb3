"""Recipe loading: types, overrides, typo suggestions, all errors at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from finetune.config import ConfigError, RecipeConfig, load_recipe, save_recipe
from finetune.errors import FinetuneError

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))

MINIMAL = {
    "model": {"name_or_path": "m"},
    "data": {"train_path": "d.jsonl", "max_length": 64},
    "optim": {"lr": "1e-5"},
    "train": {"micro_batch_size": 2, "max_steps": 3},
    "output": {"dir": "out"},
}


def write(tmp_path: Path, recipe: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(REPO)) for p in RECIPES])
def test_every_recipe_loads_and_starts_with_its_launch_command(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, RecipeConfig)
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("#") and "accelerate launch --config_file accelerate_configs/" in header
    assert f"-m finetune train {path.relative_to(REPO)}" in header


def test_defaults_and_yaml_exponent_strings(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert recipe.optim.lr == 1e-5  # YAML reads 1e-5 as a string; the float field converts it
    assert recipe.data.packing and recipe.data.completion_only_loss
    assert recipe.model.dtype == "float32" and not recipe.model.trust_remote_code


def test_dotted_overrides(tmp_path):
    recipe = load_recipe(
        write(tmp_path, MINIMAL),
        ["optim.lr=3e-4", "train.seed=7", "output.trackers=[tensorboard]", "data.packing=false"],
    )
    assert (recipe.optim.lr, recipe.train.seed, recipe.output.trackers) == (3e-4, 7, ["tensorboard"])
    assert recipe.data.packing is False


def test_unknown_key_suggests_nearest(tmp_path):
    bad = {**MINIMAL, "data": {**MINIMAL["data"], "pakcing": True}}
    with pytest.raises(ConfigError, match=r"unknown key data\.pakcing; did you mean data\.packing\?"):
        load_recipe(write(tmp_path, bad))


def test_all_errors_reported_at_once(tmp_path):
    bad = {**MINIMAL, "optim": {"lr": 1e-5, "schedule": "cosin"}}
    with pytest.raises(ConfigError) as info:
        load_recipe(write(tmp_path, bad), ["train.micro_batch_size=two", "bogus.x=1", "model.name_or_path="])
    message = str(info.value)
    assert message.startswith("4 problems in")
    for fragment in (
        "unknown key bogus; valid keys: model, data, optim, train, output, checkpoint",
        "optim.schedule must be one of cosine, linear, constant; got 'cosin'",
        "train.micro_batch_size must be an int, got 'two'",
        "model.name_or_path is empty; give it a str value",
    ):
        assert fragment in message


def test_an_interval_left_empty_means_never_and_other_empty_settings_say_what_to_write(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["train.eval_every_steps=null", "checkpoint.save_every_steps="])
    assert (recipe.train.eval_every_steps, recipe.checkpoint.save_every_steps) == (0, 0)  # as 0: only at the end
    with pytest.raises(ConfigError, match=r"train.log_every_steps is empty; give it an int value"):
        load_recipe(write(tmp_path, MINIMAL), ["train.log_every_steps=null"])


def test_missing_required_keys(tmp_path):
    bad = {key: value for key, value in MINIMAL.items() if key != "output"}
    bad["optim"] = {}
    with pytest.raises(ConfigError) as info:
        load_recipe(write(tmp_path, bad))
    assert "missing required key optim.lr" in str(info.value)
    assert "missing required key output" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.num_epochs=1"], "set exactly one of train.max_steps and train.num_epochs"),
        (["train.max_steps=0"], "train.max_steps must be >= 1"),
        (["data.eval_fraction=0.1", "data.eval_path=e.jsonl"], "set data.eval_path or data.eval_fraction, not both"),
        (["optim.lr=0"], "optim.lr must be > 0"),
        (["data.max_length=4"], "data.max_length must be >= 8"),
        (["optim.adam_beta1=1.5"], r"optim.adam_beta1 must be in \[0, 1\), got 1.5"),
        (["optim.adam_beta2=-0.1"], r"optim.adam_beta2 must be in \[0, 1\)"),
        (["optim.adam_eps=-1e-8"], "optim.adam_eps must be >= 0"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0"),
        (["output.dir=' '"], "output.dir is empty; name a folder for this run"),
        (["output.trackers=[tensorbord]"], "output.trackers names tensorbord; use any of tensorboard, wandb"),
        (["train.profile_steps=[5]"], r"profile_steps must be \[first, last\] with 1 <= first <= last, got \[5\]"),
        (["train.profile_steps=[4,2]"], r"train.profile_steps must be \[first, last\]"),
    ],
)
def test_cross_field_checks_name_the_fix(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(write(tmp_path, MINIMAL), overrides)


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_recipe(write(tmp_path, MINIMAL), ["optim.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_saved_recipe_round_trips(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["optim.lr=2e-4"])
    save_recipe(recipe, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_refused_in_every_numeric_field(tmp_path, value):
    """NaN passes every range check (all comparisons are false): a NaN max_grad_norm once exported all-NaN weights."""
    fields = ["optim.lr", "optim.max_grad_norm", "optim.adam_eps", "train.max_steps", "train.micro_batch_size"]
    with pytest.raises(ConfigError) as info:
        load_recipe(write(tmp_path, MINIMAL), [f"{name}={value}" for name in fields])
    assert str(info.value).startswith(f"{len(fields)} problems")
    for name in fields:
        assert f"{name} must be a finite number" in str(info.value)


def test_problems_of_one_section_do_not_hide_its_other_problems(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_recipe(write(tmp_path, MINIMAL), ["peft.method=qlora", "peft.dropout=2", "peft.r=0"])
    message = str(info.value)
    assert message.startswith("3 problems in") and "peft.method must be one of" in message
    assert "peft.dropout must be in [0, 1), got 2.0" in message and "peft.r must be >= 1, got 0" in message


def test_overrides_yaml_cannot_read_are_one_line_or_text(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train=\[\{path: x.jsonl\} is not valid YAML \(expected ',' or ']'"):
        load_recipe(write(tmp_path, MINIMAL), ["data.train_path=", "data.train=[{path: x.jsonl}"])
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"  # not YAML, but text
    assert load_recipe(write(tmp_path, MINIMAL), [f"data.chat_template={template}"]).data.chat_template == template


def test_a_list_of_names_may_be_written_as_one_name(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["peft.target_modules=all-linear", "peft.modules_to_save=lm_head"])
    assert recipe.peft.target_modules == ["all-linear"] and recipe.peft.modules_to_save == ["lm_head"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["peft.r=8", "output.export_merged=true", "output.export=false"],
         "output.export_merged=true needs output.export=true"),
        (["train.profile_steps=[4,5]"], r"train.profile_steps=\[4, 5\] starts after the last step \(3\)"),
        (["data.completion_only_loss=false", "data.train_on_reasoning=false"],
         "data.train_on_reasoning=false keeps reasoning out of the loss, but data.completion_only_loss=false"),
    ],
)  # fmt: skip
def test_settings_that_would_have_no_effect_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(write(tmp_path, MINIMAL), overrides)


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        ("fsdp1_full_shard.yaml", ["peft.r=8"], "adapters \\(peft\\) train under FSDP2, DDP or one process, not"),
        ("fsdp1_full_shard.yaml", [], "eval.generate answers prompts under FSDP2, DDP or one process, not FSDP1"),
        ("single_node.yaml", ["peft.r=8"], "adapters \\(peft\\) do not support rank-0 loading yet"),
        ("ddp.yaml", ["checkpoint.async_save=true"], "checkpoint.async_save needs full fine-tuning under FSDP2"),
        ("fsdp2_shard_grad_op.yaml", ["checkpoint.async_save=true"], "with fsdp_state_dict_type: SHARDED_STATE_DICT"),
        ("fsdp2_full_shard.yaml", ["checkpoint.async_save=true", "peft.r=8"], "async_save needs full fine-tuning"),
    ],
)  # fmt: skip
def test_check_and_training_refuse_the_same_launches(config, overrides, message):
    """`finetune check` refuses, from the config file, exactly what training's preflight refuses from the
    environment `accelerate launch` sets: one list (`recipe_launch_problems`), before anything loads."""
    from accelerate.commands.config.config_args import load_config_from_file

    from finetune.engine.launch import environment_problems, read_launch
    from finetune.plan.verdict import check, parse_memory

    recipe = load_recipe(REPO / "recipes" / "demo" / "tiny_llama.yaml", overrides)
    launch = read_launch(REPO / "accelerate_configs" / config, 2, 1, for_launch=False)
    with pytest.raises(FinetuneError, match=message):
        check(recipe, launch, parse_memory("80GB"))
    raw = load_config_from_file(str(REPO / "accelerate_configs" / config))
    fsdp = raw.fsdp_config or {}
    environ = {  # what accelerate launch exports from that file
        "ACCELERATE_USE_FSDP": str(raw.distributed_type == "FSDP").lower(),
        "FSDP_VERSION": str(fsdp.get("fsdp_version", 1)),
        "FSDP_CPU_RAM_EFFICIENT_LOADING": str(fsdp.get("fsdp_cpu_ram_efficient_loading", False)).lower(),
        **({"FSDP_STATE_DICT_TYPE": fsdp["fsdp_state_dict_type"]} if "fsdp_state_dict_type" in fsdp else {}),
    }
    assert any(re.search(message, problem) for problem in environment_problems(recipe, environ))


def test_a_renamed_key_keeps_working_with_a_note_naming_the_new_one(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    recipe = load_recipe(write(tmp_path, MINIMAL), ["train.loss=full_logits"])
    assert recipe.train.loss_path == "full_logits"
    assert "note: train.loss is now train.loss_path; read as such" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # said once per launch, by rank 0
    load_recipe(write(tmp_path, MINIMAL), ["train.loss=full_logits"])
    assert capsys.readouterr().err == ""


def test_a_global_batch_gives_the_accumulation_of_each_launch_and_is_refused_where_it_does_not_divide():
    from helpers import DEMO_RECIPE, GRPO_RECIPE

    from finetune.engine.launch import environment_problems

    sft, rl = load_recipe(DEMO_RECIPE, []), load_recipe(GRPO_RECIPE, [])
    assert (sft.train.global_batch_size, sft.train.micro_batch_size) == (16, 8)
    assert [sft.train.accumulation(n) for n in (1, 2)] == [2, 1] and rl.train.accumulation(1) == 2
    assert environment_problems(sft, {"WORLD_SIZE": "2"}) == []
    (problem,) = environment_problems(sft, {"WORLD_SIZE": "4"})
    assert problem == (
        "train.global_batch_size=16 is not a whole number of micro-batches of 8 on 4 data-parallel process(es) "
        "(32 samples a round); set it to a multiple of 32 (e.g. 32 or 64), or change train.micro_batch_size"
    )
    # Processes that share rows (sequence groups) are one data-parallel process.
    sequence_groups = {
        "WORLD_SIZE": "4", "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
    }  # fmt: skip
    assert not [p for p in environment_problems(sft, sequence_groups) if "global_batch_size" in p]
    with pytest.raises(ConfigError, match="unset one"):
        load_recipe(DEMO_RECIPE, ["train.gradient_accumulation_steps=2"])
    unset = load_recipe(DEMO_RECIPE, ["train.global_batch_size=null"])
    assert [unset.train.accumulation(n) for n in (1, 4)] == [1, 1]
