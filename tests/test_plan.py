"""`finetune plan`: its parameter, gradient and optimizer figures match what the runs measured."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from helpers import CONFIGS, DEMO_RECIPE, REPO, LaunchedRun

from finetune.config import ModelConfig, load_recipe
from finetune.engine.launch import read_launch
from finetune.errors import FinetuneError
from finetune.model.loading import load_model_config, meta_model
from finetune.plan.estimates import activation_bytes, estimate
from finetune.plan.shape import model_shape
from finetune.plan.verdict import parse_memory

pytestmark = pytest.mark.multiprocess


def planned(run: LaunchedRun, config: str):
    recipe = load_recipe(run.output_dir / "recipe.yaml")
    launch = dataclasses.replace(read_launch(CONFIGS / config, 2, 1), mixed_precision="no")  # the runs use fp32
    from transformers import AutoConfig

    shape = model_shape(meta_model(AutoConfig.from_pretrained(recipe.model.name_or_path)))
    return shape, recipe, launch


def measured(run: LaunchedRun) -> dict:
    (entry,) = [m for m in run.metrics() if "memory/rank0/parameters" in m]
    return {key.removeprefix("memory/rank0/"): value for key, value in entry.items() if key.startswith("memory/rank0")}


@pytest.mark.parametrize(
    ("run_name", "config"),
    [
        ("fsdp2_run", "fsdp2_full_shard.yaml"),
        ("shard_grad_op_run", "fsdp2_shard_grad_op.yaml"),
        ("ddp_run", "ddp.yaml"),
    ],
)
def test_plan_matches_the_measured_state_bytes(run_name, config, request):
    run: LaunchedRun = request.getfixturevalue(run_name)
    shape, recipe, launch = planned(run, config)
    assert launch.strategy == {"fsdp2_run": "full_shard", "shard_grad_op_run": "shard_grad_op"}.get(run_name, "ddp")
    plan = estimate(shape, recipe, launch, launch.strategy)
    real = measured(run)
    assert plan.parameters == pytest.approx(real["parameters"], rel=0.05)
    assert plan.gradients == pytest.approx(real["gradients"], rel=0.05)
    assert plan.optimizer_state == pytest.approx(real["optimizer_state"], rel=0.05)


def test_activation_estimate_against_the_measured_bytes(fsdp2_run):
    """The first micro-batch of the packed fp32 run: 8 rows x 128 tokens (measured error: docs/training.md)."""
    shape, recipe, _ = planned(fsdp2_run, "fsdp2_full_shard.yaml")
    tokens = recipe.train.micro_batch_size * recipe.data.max_length
    estimate_bytes = activation_bytes(shape, tokens, 4, checkpointing="none")
    assert estimate_bytes == pytest.approx(measured(fsdp2_run)["activations"], rel=0.25)


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "plan", str(DEMO_RECIPE), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_command_gives_a_table_and_a_verdict(demo_assets):
    model = f"model.name_or_path={demo_assets / 'base'}"
    config = str(CONFIGS / "fsdp2_full_shard.yaml")
    result = run_plan(model, "--config", config, "--num-processes", "2", "--gpu-memory", "1GB")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "858,752 parameters" in result.stdout and "* full_shard" in result.stdout
    assert "verdict (* = this config): fits" in result.stdout
    assert "activation checkpointing (this run: none), activations per device: none" in result.stdout
    # The cheapest policy that fits: selective (keeps matmul outputs), then full.
    # Overrides may follow the options too, as with `make plan ARGS=...` after them.
    tight = run_plan("--config", config, "--num-processes", "2", "--gpu-memory", "0.035GB", model)
    assert "fits with selective activation checkpointing (train.activation_checkpointing: selective)" in tight.stdout
    tighter = run_plan(model, "--config", config, "--num-processes", "2", "--gpu-memory", "0.025GB")
    assert "fits with activation checkpointing (train.activation_checkpointing: full)" in tighter.stdout
    tiny = run_plan(model, "--config", config, "--num-processes", "2", "--gpu-memory", "1MB")
    assert "does not fit" in tiny.stdout
    bad = run_plan(model, "--config", config, "--num-processes", "3", "--num-machines", "2")
    assert bad.returncode == 2 and "NUM_PROCESSES=3 is not a multiple of NUM_MACHINES=2" in bad.stderr
    bad = run_plan(model, "--config", config, "--num-processes", "2", "--gpu-memory", "80XB")
    assert bad.returncode == 2 and "write it like 80GB" in bad.stderr


def test_plan_refuses_a_launch_that_check_and_training_refuse(demo_assets, capsys):
    """No plan for a launch that cannot run: online RL over sequence groups, a stray option."""
    from finetune.cli import main

    grpo = str(REPO / "recipes" / "demo" / "tiny_llama_grpo.yaml")
    model = f"model.name_or_path={demo_assets / 'base'}"
    config = str(CONFIGS / "sequence_parallel.yaml")
    assert main(["plan", grpo, "--config", config, "--num-processes", "8", model]) == 2
    assert "online RL (rl) samples whole completions on each process, and sequence parallelism" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["plan", grpo, "--config", config, "--gpu-memory", "1GB", "--typo"])
    assert "unrecognized arguments: --typo" in capsys.readouterr().err


def test_plan_and_check_hold_rows_to_the_positions_the_model_attends(demo_assets, capsys):
    """The longest row is capped at the model's positions (after config_overrides), and a data.max_length past them
    is refused by plan and check as training refuses it."""
    from finetune.cli import main

    model = f"model.name_or_path={demo_assets / 'base'}"
    config = ["--config", str(CONFIGS / "fsdp2_full_shard.yaml"), "--num-processes", "2", "--gpu-memory", "80GB"]
    assert main(["plan", str(DEMO_RECIPE), *config, model]) == 0
    assert re.search(r"longest data.max_length this launch fits: 256 tokens, the model's positions \(memory alone "
                     r"would allow [\d,]+; with ", capsys.readouterr().out)  # fmt: skip
    for command in ("plan", "check"):
        assert main([command, str(DEMO_RECIPE), *config, model, "data.max_length=512"]) == 2
        assert "data.max_length=512 exceeds the 256 positions of" in capsys.readouterr().err
    longer = "model.config_overrides={max_position_embeddings: 2048}"
    assert main(["plan", str(DEMO_RECIPE), *config, model, longer, "data.max_length=512"]) == 0
    assert "fits: 2,048 tokens, the model's positions" in capsys.readouterr().out


def test_plan_inputs_that_cannot_be_planned(tmp_path):
    with pytest.raises(FinetuneError, match="--gpu-memory '0GB' is no memory"):
        parse_memory("0GB")
    missing = tmp_path / "no_model"
    with pytest.raises(FinetuneError, match=f"model.name_or_path {missing} is not a folder"):
        load_model_config(ModelConfig(name_or_path=str(missing)))


def test_auto_checkpointing_takes_the_least_recomputation_that_fits():
    """`train.activation_checkpointing: auto`: none where everything fits, then selective, then full, by the
    same estimate as the plan's verdict; none on CPU (no device memory to fit)."""
    from finetune.plan.shape import planned_model
    from finetune.plan.verdict import cheapest_policy, plan

    recipe = load_recipe(REPO / "recipes" / "llama" / "llama-3.1-8b.yaml", ["train.activation_checkpointing=auto"])
    launch = read_launch(CONFIGS / "fsdp2_full_shard.yaml", 8, 1)
    shape = model_shape(planned_model(recipe))
    chosen = estimate(shape, recipe, launch, launch.strategy)
    peaks = {policy: chosen.device_peak(policy) for policy in ("none", "selective", "full")}
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    fitting = {policy: holding(peak) for policy, peak in peaks.items()}
    assert cheapest_policy(chosen, fitting["none"]) == "none"
    assert cheapest_policy(chosen, fitting["none"] - 1) == "selective"
    assert cheapest_policy(chosen, fitting["selective"] - 1) == "full"
    assert cheapest_policy(chosen, fitting["full"] - 1) == "full"  # the verdict says what else
    assert cheapest_policy(chosen, None) == "none"
    assert cheapest_policy(chosen, peaks["none"]) == "selective"  # a device just as large leaves no headroom
    assert "(this run: auto, so selective)" in plan(recipe, launch, fitting["none"] - 1)


def holding(peak: int) -> int:
    """The least device memory whose usable part (less the plan's headroom) holds `peak` bytes."""
    from finetune.plan.verdict import usable_memory

    low, high = peak, 2 * peak + 2**31  # usable_memory(low) < peak <= usable_memory(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if usable_memory(middle) >= peak else (middle, high)
    return high


def test_online_rl_plans_its_generation_phase():
    """The rollout: KV cache for a step's completions, the model gathered once where it fits half of what the
    sharded state leaves (else per layer), a decoding step's logits; gradients freed. Its peak counts in the
    verdict where it exceeds training's."""
    from finetune.plan.shape import planned_model
    from finetune.plan.verdict import plan

    recipe = load_recipe(REPO / "recipes" / "qwen" / "qwen3-8b-grpo-math.yaml")
    launch = read_launch(CONFIGS / "single_node.yaml", 8, 1)
    shape = model_shape(planned_model(recipe))
    chosen = estimate(shape, recipe, launch, launch.strategy)
    rollout = chosen.generation
    rows = recipe.train.micro_batch_size * recipe.rl.num_generations
    assert rollout.kv_cache == rows * recipe.data.max_length * shape.layers * 2 * shape.kv_hidden * 2  # bf16
    assert rollout.whole == shape.parameters * 2 and rollout.per_layer == chosen.gather_buffers
    assert rollout.gathers_once(chosen, 80 * 2**30) and not rollout.gathers_once(chosen, 40 * 2**30)
    report = plan(recipe, launch, 80 * 2**30)
    assert f"generation (rl: {rows} completions a step): KV cache" in report
    assert "the whole model gathered once per rollout" in report
    assert "parameters gathered per layer at every token" in plan(recipe, launch, 40 * 2**30)
    # A static cache: each row's length rounded up to 256 (2,560 is already), beside the prompts' dynamic cache.
    static = load_recipe(REPO / "recipes" / "qwen" / "qwen3-8b-grpo-math.yaml", ["rl.rollout_cache=static"])
    prompts = recipe.data.max_length - recipe.rl.max_new_tokens
    assert (
        estimate(shape, static, launch, launch.strategy).generation.kv_cache
        == rollout.kv_cache * (recipe.data.max_length + prompts) // recipe.data.max_length
    )
    assert f"generation (rl, a static cache: {rows} completions a step)" in plan(static, launch, 80 * 2**30)
    # Agents' episodes: room for the answers' padding, half an episode's more (the cache is rebuilt past it).
    tools = load_recipe(REPO / "recipes" / "qwen" / "qwen3-8b-grpo-tools.yaml")
    assert tools.data.max_length == recipe.data.max_length and tools.rl.max_turns == 4
    assert estimate(shape, tools, launch, launch.strategy).generation.kv_cache == rollout.kv_cache * 3 // 2
    assert "episodes of up to 4 turns with room for their answers' padding" in plan(tools, launch, 80 * 2**30)
    longer = load_recipe(REPO / "recipes" / "qwen" / "qwen3-8b-grpo-math.yaml", ["train.global_batch_size=1024"])
    crowded = estimate(shape, longer, launch, launch.strategy)  # a rollout of 1,024 completions outweighs a step
    assert crowded.device_peak("full") == crowded.generation.total(crowded) > crowded.device_total("full")
