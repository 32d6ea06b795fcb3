"""Every shipped recipe, offline: its architecture builds on the meta device, its wrap class is in it,
its header's launch command and its make target agree, and `finetune check` passes for that launch."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from helpers import CONFIGS, REPO

from finetune.config import load_recipe
from finetune.engine.launch import read_launch
from finetune.engine.wrap import wrap_classes
from finetune.model.loading import load_model_config, meta_model
from finetune.plan.shape import model_shape
from finetune.plan.verdict import check, parse_memory

# Published parameter counts: a shipped config.json that drifted from the real model fails here.
MODELS = {
    "recipes/gpt2/gpt2-small.yaml": ("GPT2Block", 124_439_808),
    "recipes/gpt2/gpt2-medium.yaml": ("GPT2Block", 354_823_168),
    "recipes/gpt2/gpt2-xl.yaml": ("GPT2Block", 1_557_611_200),
    "recipes/llama/llama-3.2-1b.yaml": ("LlamaDecoderLayer", 1_235_814_400),
    "recipes/llama/llama-3.1-8b.yaml": ("LlamaDecoderLayer", 8_030_261_248),
    "recipes/llama/llama-3.1-70b.yaml": ("LlamaDecoderLayer", 70_553_706_496),
    "recipes/qwen/qwen2.5-7b.yaml": ("Qwen2DecoderLayer", 7_615_616_512),
    "recipes/mistral/mistral-7b.yaml": ("MistralDecoderLayer", 7_248_023_552),
    "recipes/llama/llama-3.1-8b-lora.yaml": ("LlamaDecoderLayer", 8_030_261_248),
    "recipes/qwen/qwen2.5-7b-lora.yaml": ("Qwen2DecoderLayer", 7_615_616_512),
    "recipes/llama/llama-3.1-70b-qlora.yaml": ("LlamaDecoderLayer", 70_553_706_496),
    "recipes/qwen/qwen3-8b-reasoning.yaml": ("Qwen3DecoderLayer", 8_190_735_360),  # 8.2B, 6.95B without embeddings
    "recipes/qwen/qwen3-8b-reasoning-128k.yaml": ("Qwen3DecoderLayer", 8_190_735_360),
    "recipes/qwen/qwen3-30b-a3b.yaml": ("Qwen3MoeDecoderLayer", 30_532_122_624),  # 30.5B, 3.3B active
    "recipes/qwen/qwen3-30b-a3b-reasoning-64k.yaml": ("Qwen3MoeDecoderLayer", 30_532_122_624),
    "recipes/qwen/qwen3-30b-a3b-lora.yaml": ("Qwen3MoeDecoderLayer", 30_532_122_624),
    "recipes/gpt-oss/gpt-oss-20b-lora.yaml": ("GptOssDecoderLayer", 20_914_757_184),  # 20.9B, 3.6B active
    "recipes/mistral/mixtral-8x7b-lora.yaml": ("MixtralDecoderLayer", 46_702_792_704),  # 46.7B, 12.9B active
    "recipes/qwen/qwen2.5-7b-tools-lora.yaml": ("Qwen2DecoderLayer", 7_615_616_512),
    "recipes/llama/llama-3.1-8b-dpo.yaml": ("LlamaDecoderLayer", 8_030_261_248),
    "recipes/qwen/qwen2.5-7b-dpo-lora.yaml": ("Qwen2DecoderLayer", 7_615_616_512),
    "recipes/qwen/qwen3-8b-grpo-math.yaml": ("Qwen3DecoderLayer", 8_190_735_360),
    "recipes/qwen/qwen3-8b-grpo-math-lora.yaml": ("Qwen3DecoderLayer", 8_190_735_360),
    "recipes/qwen/qwen3-8b-grpo-tools.yaml": ("Qwen3DecoderLayer", 8_190_735_360),
    "recipes/qwen/qwen3-1.7b-distill.yaml": ("Qwen3DecoderLayer", 1_720_574_976),  # 1.7B, 1.4B without embeddings
    "recipes/qwen/qwen3-1.7b-distill-on-policy.yaml": ("Qwen3DecoderLayer", 1_720_574_976),
}


def header_launch(path: str) -> list[str]:
    """The `accelerate launch ...` command written in a recipe's header, as arguments."""
    header = (REPO / path).read_text().split("\n\n")[0]
    lines = [line.removeprefix("#").strip() for line in header.splitlines()]
    command = " ".join(lines[next(i for i, line in enumerate(lines) if line.startswith("accelerate launch")) :])
    return shlex.split(command.replace("\\", " ").replace("<", "'<").replace(">", ">'"))


def flag(arguments: list[str], name: str) -> str | None:
    return arguments[arguments.index(name) + 1] if name in arguments else None


def make_variables(target: str) -> dict[str, str]:
    """What `make <target>` would run, read from make's dry run."""
    dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout
    launch = shlex.split(next(line for line in dry.splitlines() if "accelerate launch" in line))
    return {
        "config": flag(launch, "--config_file"),
        "processes": flag(launch, "--num_processes"),
        "machines": flag(launch, "--num_machines"),
        "wrap": flag(launch, "--fsdp_transformer_layer_cls_to_wrap"),
        "recipe": launch[launch.index("train") + 1],
    }


def test_every_model_size_has_a_recipe():
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.yaml")}
    demos = {
        f"recipes/demo/tiny_llama{kind}.yaml" for kind in ("", "_grpo", "_grpo_rm", "_distill", "_reward", "_kto")
    }
    demos |= {f"recipes/demo/agent_{stage}.yaml" for stage in ("sft", "grpo")}
    assert set(MODELS) | demos == shipped


@pytest.mark.parametrize("path", sorted(MODELS))
def test_recipe_builds_offline_and_its_launch_checks_out(path):
    wrap_class, parameters = MODELS[path]
    recipe = load_recipe(REPO / path)
    assert recipe.model.config_file and (REPO / recipe.model.config_file).is_file()
    model = meta_model(load_model_config(recipe.model))
    assert model_shape(model).parameters == parameters

    launch_args = header_launch(path)
    config = REPO / flag(launch_args, "--config_file")
    machines = int(flag(launch_args, "--num_machines") or 1)
    launch = read_launch(
        config, int(flag(launch_args, "--num_processes")), machines,
        main_process_ip="10.0.0.1" if machines > 1 else None,
        wrap_classes=flag(launch_args, "--fsdp_transformer_layer_cls_to_wrap"), environ={},
    )  # fmt: skip
    assert wrap_classes(launch.wrap_classes, model) == [wrap_class]
    # The plan fits the GPUs the header names ("Hardware: ... x 80 GB ...").
    gpu = re.search(r"^# Hardware:.*?(\d+)\+? GB", (REPO / path).read_text(), re.MULTILINE).group(1)
    report = check(recipe, launch, parse_memory(f"{gpu}GB"))
    assert "memory per device: fits" in report, report

    # `make <target>` launches exactly what the header says.
    target = re.search(r"make (train-[a-z0-9.-]+)", (REPO / path).read_text()).group(1)
    made = make_variables(target)
    assert made["recipe"] == path
    assert made["config"] == str(config.relative_to(REPO)) and int(made["processes"]) == launch.num_processes
    assert int(made["machines"]) == machines
    assert (made["wrap"] or "LlamaDecoderLayer") == wrap_class


def test_unknown_architecture_offline_says_how_to_provide_it(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    text = (REPO / "recipes/llama/llama-3.1-8b.yaml").read_text()
    recipe.write_text(re.sub(r"  config_file: .*\n", "", text).replace("meta-llama/Llama-3.1-8B", "acme/Unknown-8B"))
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "check", str(recipe), "--config", str(CONFIGS / "single_node.yaml")],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not available offline" in result.stderr and "model.config_file" in result.stderr
