"""LoRA/DoRA adapters: trained under FSDP2 and DDP on 2 processes, checkpointed without the frozen base,
resumed exactly, exported as a PEFT folder that `PeftModel.from_pretrained` loads with the trained logits."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    CHECKPOINT_SETTINGS,
    CONFIGS,
    DEMO_RECIPE,
    REPO,
    LaunchedRun,
    flip_one_weight_between_samples,
    launch,
    launched_run,
    recipe_overrides,
)
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from finetune.config import PeftConfig, load_recipe
from finetune.engine.launch import environment_problems, read_launch
from finetune.errors import FinetuneError
from finetune.export.consolidate import export_checkpoint
from finetune.model.adapters import add_adapters, quantization_config, storage_dtype
from finetune.model.loading import load_model
from finetune.plan.estimates import estimate
from finetune.plan.shape import model_shape, planned_model
from finetune.run import demo
from finetune.storage.checkpoint import ADAPTER_STATE, MARKER, MODEL_FILES, check_resume_kind, trained_base
from finetune.storage.fingerprint import weights_fingerprint

pytestmark = pytest.mark.multiprocess

SEQUENCE_GROUPS_OF_2 = ("--parallelism_config_sp_size", "2")

LORA = {
    **CHECKPOINT_SETTINGS,
    "peft.r": 8,
    "peft.target_modules": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
    "optim.lr": "1e-3",
    "checkpoint.keep_last": 3,
}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """LoRA under FSDP2 full shard on 2 processes: checkpoints at steps 4, 6 and 8, the adapter exported."""
    return launched_run(tmp_path_factory, demo_assets, "lora", "fsdp2_full_shard.yaml", **LORA)


def test_adapters_on_rows_split_over_a_sequence_group_train_what_whole_rows_train(
    lora_run, tmp_path_factory, demo_assets
):
    """LoRA with every row split over 2 processes (sp=2, 16 rows a micro-batch) trains the adapter that 2
    data-parallel processes of 8 rows train."""
    split = launched_run(
        tmp_path_factory, demo_assets, "lora_sp2", "sequence_parallel.yaml",
        launch_args=(*SEQUENCE_GROUPS_OF_2, "--fsdp_cpu_ram_efficient_loading", "false"),
        **LORA, **{"train.micro_batch_size": 16, "model.attn_implementation": "varlen"},
    )  # fmt: skip
    assert "rows split over sequence groups of 2" in split.log
    ours = load_file(split.output_dir / "final" / "adapter_model.safetensors")
    theirs = load_file(lora_run.output_dir / "final" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-5
    assert split.losses() == pytest.approx(lora_run.losses(), abs=1e-5)


def test_checkpoints_hold_the_adapters_and_never_the_base(lora_run, one_process_run):
    checkpoint = lora_run.output_dir / "checkpoints" / "step_8"
    assert (checkpoint / MARKER).exists() and (checkpoint / ADAPTER_STATE / ".metadata").exists()
    assert not list(checkpoint.glob("pytorch_model_fsdp*")) and not list(checkpoint.glob("optimizer*"))
    saved = open_weights_of_adapters(checkpoint)
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved), sorted(saved)[:5]
    # 7 adapted linear layers x 4 decoder layers x (A, B)
    assert len(saved) == 7 * 4 * 2
    assert "adapters, their gradients and AdamW state in float32, gradients reduced in float32" in lora_run.log
    full = one_process_run.output_dir / "checkpoints" / "step_8"
    assert folder_bytes(checkpoint) < folder_bytes(full) / 2


def test_wrap_plan_and_memory_report_tell_trainable_from_frozen(lora_run):
    trainable = int(re.search(r"adapters: ([\d,]+) trainable parameters", lora_run.log).group(1).replace(",", ""))
    plan = re.search(
        r"FSDP wrap plan: \d+ units, [\d,]+ parameters \(([\d,]+) trainable, [\d,]+ frozen\)", lora_run.log
    )
    assert plan and int(plan.group(1).replace(",", "")) == trainable
    assert re.search(r"LlamaDecoderLayer +x4 +[\d,]+ params each, [\d,]+ trainable", lora_run.log)
    assert re.search(r"rank +params +trainable +frozen +grads", lora_run.log)
    (measured,) = [m for m in lora_run.metrics() if "memory/rank0/parameters" in m]
    for rank in (0, 1):
        held = measured[f"memory/rank{rank}/trainable_parameters"]
        assert 0 < held < measured[f"memory/rank{rank}/parameters"] / 10
        assert measured[f"memory/rank{rank}/gradients"] == held  # gradients exist for the adapters only


def test_the_exported_adapter_loads_with_peft_and_gives_the_trained_logits(lora_run, demo_assets):
    final = lora_run.output_dir / "final"
    assert sorted(p.name for p in final.glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (final / "config.json").exists()  # a PEFT folder, not a model folder
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(demo_assets / "base") and config["r"] == 8
    keys = load_file(final / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") and ".default." not in k for k in keys)
    # A fresh process, as a user would: base from its folder, adapter from ours.
    script = (
        "import sys, torch; from peft import PeftModel; from safetensors.torch import load_file; "
        "from transformers import AutoModelForCausalLM; "
        "ref = load_file(sys.argv[3]); base = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
        "model = PeftModel.from_pretrained(base, sys.argv[2]).eval(); "
        "torch.no_grad().__enter__(); out = model(input_ids=ref['input_ids']).logits; "
        "plain = AutoModelForCausalLM.from_pretrained(sys.argv[1])(input_ids=ref['input_ids']).logits; "
        "print((out - ref['logits']).abs().max().item(), (plain - ref['logits']).abs().max().item())"
    )
    args = [str(demo_assets / "base"), str(final), str(lora_run.output_dir / "final_logits.safetensors")]
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    adapted, base_only = map(float, result.stdout.split())
    assert adapted <= 1e-5 and base_only > 1e-3  # the adapter is what changed the model


def test_resume_is_exact_on_two_processes_and_on_one(lora_run, demo_assets, tmp_path):
    expected = {m["step"]: m["loss"] for m in lora_run.metrics() if "loss" in m}
    trained = load_file(lora_run.output_dir / "final" / "adapter_model.safetensors")
    for processes, tolerance in ((2, 0.0), (1, 1e-5)):
        output_dir = tmp_path / f"resumed_{processes}"
        shutil.copytree(lora_run.output_dir / "checkpoints" / "step_4", output_dir / "checkpoints" / "step_4")
        overrides = {**LORA, "checkpoint.resume": "auto", "train.micro_batch_size": 16 // processes}
        result = launch(
            "fsdp2_full_shard.yaml", recipe_overrides(demo_assets, output_dir, **overrides), num_processes=processes
        )
        assert result.returncode == 0, result.stderr[-4000:]
        resumed = LaunchedRun(result, output_dir)
        losses = {m["step"]: m["loss"] for m in resumed.metrics() if "loss" in m}
        assert sorted(losses) == [5, 6, 7, 8]
        for step, loss in losses.items():
            assert abs(loss - expected[step]) <= tolerance, (processes, step, loss, expected[step])
        adapter = load_file(output_dir / "final" / "adapter_model.safetensors")
        assert max((adapter[k] - trained[k]).abs().max().item() for k in trained) <= tolerance


@pytest.mark.parametrize(
    ("config", "launch_args"),
    [
        ("fsdp2_shard_grad_op.yaml", ()),
        # The offload preset with its activation checkpointing, loading on every rank (adapters refuse rank-0 loading).
        ("fsdp2_offload.yaml", ("--fsdp_cpu_ram_efficient_loading", "false")),
    ],
)
def test_lora_under_shard_grad_op_and_cpu_offload_trains_as_under_full_shard(
    config, launch_args, lora_run, demo_assets, tmp_path
):
    result = launch(config, recipe_overrides(demo_assets, tmp_path / "out", **LORA), launch_args=launch_args)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = {m["step"]: m["loss"] for m in LaunchedRun(result, tmp_path / "out").metrics() if "loss" in m}
    expected = {m["step"]: m["loss"] for m in lora_run.metrics() if "loss" in m}
    assert sorted(losses) == sorted(expected) == list(range(1, 9))
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], abs=1e-5), (step, loss, expected[step])


@pytest.fixture(scope="module")
def dora_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """DoRA on every linear layer plus a fully trained lm_head, under DDP, exported merged at the end too."""
    return launched_run(
        tmp_path_factory, demo_assets, "dora_ddp", "ddp.yaml",
        **{
            **LORA, "peft.method": "dora", "peft.target_modules": "[all-linear]", "peft.modules_to_save": "[lm_head]",
            "train.max_steps": 4, "output.export_merged": "true",
        },
    )  # fmt: skip


def test_dora_under_ddp_trains_and_exports(dora_run, lora_run):
    assert demo.exported_model(dora_run.output_dir) == dora_run.output_dir / "final_merged"  # what the report reads
    assert demo.exported_model(lora_run.output_dir) == lora_run.output_dir / "final_merged"
    losses = dora_run.losses()
    assert losses[-1] < losses[0]
    keys = load_file(dora_run.output_dir / "final" / "adapter_model.safetensors")
    assert any("lora_magnitude_vector" in k for k in keys) and "base_model.model.lm_head.weight" in keys
    assert json.loads((dora_run.output_dir / "final" / "adapter_config.json").read_text())["use_dora"] is True


@pytest.mark.parametrize("run_name", ["lora_run", "dora_run"])
def test_merged_export_is_bit_identical_to_peft_merge_and_unload(run_name, request, demo_assets, tmp_path):
    """Streamed from the base's files one shard at a time, with PEFT's arithmetic: the same bits in fp32."""
    run: LaunchedRun = request.getfixturevalue(run_name)
    merged = run.output_dir / "final_merged"
    if not merged.exists():  # the LoRA run did not ask for it at the end of training: export it now
        merged = tmp_path / "merged"
        result = subprocess.run(
            [sys.executable, "-m", "finetune", "export", str(run.output_dir), str(merged), "--merge"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    assert not list(merged.glob("adapter_*"))
    base = AutoModelForCausalLM.from_pretrained(demo_assets / "base")
    expected = PeftModel.from_pretrained(base, run.output_dir / "final").merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(merged).state_dict()
    assert sorted(ours) == sorted(expected)
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    untouched = AutoModelForCausalLM.from_pretrained(demo_assets / "base").state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ours[name], untouched[name])


def test_merge_of_a_full_checkpoint_is_refused(one_process_run, tmp_path):
    with pytest.raises(FinetuneError, match="is of a full fine-tuning run, whose export is the whole model already"):
        export_checkpoint(one_process_run.output_dir, tmp_path / "out", merge=True)
    assert not (tmp_path / "out").exists()


QLORA = {**LORA, "peft.quantization": "nf4", "peft.target_modules": "[all-linear]", "train.max_steps": 4}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """QLoRA under FSDP2 on 2 processes in fp32 (4-bit weights packed in fp32 storage), merged at the end."""
    return launched_run(
        tmp_path_factory, demo_assets, "qlora", "fsdp2_full_shard.yaml", **QLORA, **{"output.export_merged": "true"}
    )


def per_rank(run: LaunchedRun, key: str) -> list[int]:
    (entry,) = [m for m in run.metrics() if "memory/rank0/parameters" in m]
    return [entry[f"memory/rank{rank}/{key}"] for rank in (0, 1)]


def test_qlora_shards_the_4bit_base_and_reproduces_its_logits(qlora_run, demo_assets):
    assert "its linear weights in 4 bits (nf4, packed in float32 storage" in qlora_run.log
    # Counted as the weights they stand for: all of the demo model's linear layers but the head.
    base = AutoModelForCausalLM.from_pretrained(demo_assets / "base")
    linear = sum(m.weight.numel() for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert f"{sum(p.numel() for p in base.parameters()):,} frozen, {linear:,} of them in 4 bits" in qlora_run.log
    full_parameters = sum(
        p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(demo_assets / "base").parameters()
    )
    assert max(per_rank(qlora_run, "parameters")) < 0.4 * full_parameters  # 4 bits, and sharded over 2 ranks
    saved = open_weights_of_adapters(qlora_run.output_dir / "checkpoints" / "step_4")
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    # The adapter on the base loaded in 4 bits the same way, in a fresh process: the trained model exactly.
    script = (
        "import sys, torch; from peft import PeftModel; from safetensors.torch import load_file; "
        "from transformers import AutoModelForCausalLM, BitsAndBytesConfig; ref = load_file(sys.argv[3]); "
        "q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, "
        "bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32); "
        "base = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=q, dtype=torch.float32); "
        "model = PeftModel.from_pretrained(base, sys.argv[2]).eval(); torch.no_grad().__enter__(); "
        "print((model(input_ids=ref['input_ids']).logits - ref['logits']).abs().max().item())"
    )
    final = qlora_run.output_dir / "final"
    args = [str(demo_assets / "base"), str(final), str(qlora_run.output_dir / "final_logits.safetensors")]
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split()[-1]) <= 1e-5


def test_qlora_merges_onto_the_base_training_saw(qlora_run, tmp_path):
    """The default merge dequantizes the base as training loaded it; onto the original weights is further off."""
    original = tmp_path / "original"
    command = [sys.executable, "-m", "finetune", "export", str(qlora_run.output_dir), str(original)]
    result = subprocess.run([*command, "--merge", "--merge-onto", "original"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = load_file(qlora_run.output_dir / "final_logits.safetensors")

    def distance(folder: Path) -> float:
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config  # a plain model: its weights are ordinary tensors
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(folder)(input_ids=reference["input_ids"]).logits
        return (logits - reference["logits"]).abs().max().item()

    dequantized = distance(qlora_run.output_dir / "final_merged")
    assert dequantized * 10 < distance(original), dequantized


def test_qlora_trains_with_bf16_storage_under_bf16_mixed_precision(tmp_path, demo_assets):
    """The setting real QLoRA runs use (the 70B recipe's): base in bf16 storage, FSDP2 bf16 mixed precision,
    activation checkpointing; sharded, finite."""
    overrides = {
        **QLORA, "model.dtype": "bfloat16", "train.max_steps": 2, "checkpoint.save_every_steps": 0,
        "train.activation_checkpointing": "true",
    }  # fmt: skip
    result = launch(
        "fsdp2_full_shard.yaml", recipe_overrides(demo_assets, tmp_path / "out", **overrides),
        launch_args=("--mixed_precision", "bf16"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    run = LaunchedRun(result, tmp_path / "out")
    assert "frozen base in bfloat16, its linear weights in 4 bits (nf4, packed in bfloat16 storage" in run.log
    assert "compute in bfloat16" in run.log and all(math.isfinite(loss) for loss in run.losses())
    assert per_rank(run, "parameters")[0] == pytest.approx(per_rank(run, "parameters")[1], rel=0.1)
    assert (run.output_dir / "final" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("run_name", ["lora_run", "qlora_run"])
def test_plan_counts_adapter_state_as_measured(run_name, request):
    """`finetune plan`'s parameter, gradient and AdamW figures for an adapter recipe (QLoRA: its 4-bit base),
    against the run's own report."""
    run: LaunchedRun = request.getfixturevalue(run_name)
    recipe = load_recipe(run.output_dir / "recipe.yaml")
    launch = dataclasses.replace(read_launch(CONFIGS / "fsdp2_full_shard.yaml", 2, 1), mixed_precision="no")
    shape = model_shape(planned_model(recipe))
    assert 0 < shape.trainable < shape.parameters / 10
    plan = estimate(shape, recipe, launch, "full_shard")
    (measured,) = [m for m in run.metrics() if "memory/rank0/parameters" in m]
    for key in ("parameters", "gradients", "optimizer_state"):
        assert getattr(plan, key) == pytest.approx(measured[f"memory/rank0/{key}"], rel=0.05), key


def test_qlora_plan_counts_the_whole_4bit_base_at_load(qlora_run):
    """What a process holds right after loading a QLoRA base, before sharding (transformers puts it all on the
    process's device): the packed weights, their block scales and the rest of the model, as the plan says."""
    recipe = load_recipe(qlora_run.output_dir / "recipe.yaml")
    model = add_adapters(load_model(recipe.model, False, quantization=quantization_config(torch.float32)), recipe.peft)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:  # 8-bit block scales, and their own fp32 scales (double quantization)
            loaded += state.absmax.numel() * state.absmax.element_size() + state.state2.absmax.numel() * 4
    launch = read_launch(CONFIGS / "fsdp2_full_shard.yaml", 2, 1)
    plan = estimate(model_shape(planned_model(recipe)), recipe, launch, "full_shard")
    assert plan.device_at_load == pytest.approx(loaded, rel=0.05)
    assert plan.device_at_load > 1.8 * plan.parameters  # the whole base, not the shard of it


def test_bad_adapter_input_names_the_fix(demo_assets, tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(demo_assets / "base")
    with pytest.raises(FinetuneError, match=r"target_modules names qkv_proj, which LlamaForCausalLM does not have"):
        add_adapters(model, PeftConfig(target_modules=["qkv_proj"]))
    tied = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=True))
    with pytest.raises(FinetuneError, match="whose input and output embeddings are tied"):
        add_adapters(tied, PeftConfig(modules_to_save=["lm_head"]))
    recipe = load_recipe(DEMO_RECIPE, ["peft.r=4", "eval.generate=null"])  # its own refusal under FSDP1 aside
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}
    (problem,) = environment_problems(recipe, environ)
    assert "not FSDP1; launch with accelerate_configs/fsdp2_full_shard.yaml" in problem
    environ.update(FSDP_VERSION="2", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    (problem,) = environment_problems(recipe, environ)
    assert "fsdp_cpu_ram_efficient_loading: false" in problem
    # QLoRA under bf16 compute packs its 4-bit weights in bf16 whatever model.dtype is: no refusal, the dtype chosen
    environ.update(FSDP_CPU_RAM_EFFICIENT_LOADING="false", ACCELERATE_MIXED_PRECISION="bf16")
    assert environment_problems(load_recipe(DEMO_RECIPE, ["peft.quantization=nf4"]), environ) == []
    assert storage_dtype(torch.float32, "bf16") == torch.bfloat16
    assert storage_dtype(torch.float32, "no") == torch.float32
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(FinetuneError, match="peft.quantization=nf4 needs bitsandbytes; install it"):
        quantization_config(torch.bfloat16)


def test_checkpoints_resume_only_their_own_kind(lora_run, one_process_run):
    with pytest.raises(FinetuneError, match="is of an adapter run but the recipe has no peft section"):
        check_resume_kind(lora_run.output_dir / "checkpoints" / "step_8", adapters=False)
    with pytest.raises(FinetuneError, match="is of a full fine-tuning run but the recipe has one"):
        check_resume_kind(one_process_run.output_dir / "checkpoints" / "step_8", adapters=True)


def test_adapters_resume_and_merge_only_on_the_base_they_trained_on(lora_run, demo_assets, tmp_path):
    """A base changed under its name (here: one weight, as little as a re-export in place changes) is refused by
    resume and by --merge, before anything is written; the same base copied elsewhere is the same base."""
    base, step_4 = demo_assets / "base", lora_run.output_dir / "checkpoints" / "step_4"
    assert weights_fingerprint(shutil.copytree(base, tmp_path / "copy")) == weights_fingerprint(base)
    assert trained_base(step_4) == weights_fingerprint(base)
    changed = shutil.copytree(base, tmp_path / "changed")
    flip_one_weight_between_samples(changed / "model.safetensors")  # one weight, by its last bit
    assert weights_fingerprint(changed) != weights_fingerprint(base)

    output_dir = tmp_path / "resume"
    resumed = shutil.copytree(step_4, output_dir / "checkpoints" / "step_4")
    state = json.loads((resumed / "trainer_state.json").read_text())  # as if trained on the changed folder's name
    (resumed / "trainer_state.json").write_text(json.dumps({**state, "model_name_or_path": str(changed)}))
    overrides = recipe_overrides(
        demo_assets, output_dir, **{**LORA, "checkpoint.resume": "auto", "model.name_or_path": changed}
    )
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "train", DEMO_RECIPE, *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "trained its adapters on another base model than" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in output_dir.rglob("*") if p.parent == output_dir) == ["checkpoints"]

    checkpoint = shutil.copytree(lora_run.output_dir / "checkpoints" / "step_8", tmp_path / "step_8")
    adapter_config = checkpoint / MODEL_FILES / "adapter_config.json"
    config = json.loads(adapter_config.read_text())
    adapter_config.write_text(json.dumps({**config, "base_model_name_or_path": str(changed)}))
    with pytest.raises(FinetuneError, match="is not the one the adapter trained on"):
        export_checkpoint(checkpoint, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()


def open_weights_of_adapters(checkpoint: Path) -> dict[str, torch.Size]:
    from finetune.export.weight_files import ShardedWeights

    return ShardedWeights(checkpoint / ADAPTER_STATE).shapes


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_base_saved_quantized_trains_adapters_as_it_is_and_nothing_else(demo_assets, tmp_path):
    """`*-bnb-4bit` hub models store their weights as 4-bit codes (uint8 storage, quantization_config in
    config.json): adapters train on them as they are, on 2 processes, and the adapter loads onto them with PEFT
    with the trained logits; full fine-tuning and merged exports, which would need the weights, are refused."""
    from transformers import AutoTokenizer, BitsAndBytesConfig

    from finetune.config import ModelConfig
    from finetune.model.loading import check_quantized_base

    base = tmp_path / "tiny-bnb-4bit"
    stored = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    AutoModelForCausalLM.from_pretrained(demo_assets / "base", quantization_config=stored).save_pretrained(base)
    AutoTokenizer.from_pretrained(demo_assets / "base").save_pretrained(base)
    with pytest.raises(FinetuneError, match=r"is stored quantized \(bitsandbytes\): its weights are codes"):
        check_quantized_base(ModelConfig(name_or_path=str(base)), adapters=False)
    with pytest.raises(FinetuneError, match="a merged export would fold the adapter into 4-bit codes"):
        check_quantized_base(ModelConfig(name_or_path=str(base)), adapters=True, export_merged=True)

    output_dir = tmp_path / "out"
    overrides = {**LORA, "model.name_or_path": base, "train.max_steps": 4, "checkpoint.save_every_steps": 0}
    result = launch("fsdp2_full_shard.yaml", recipe_overrides(demo_assets, output_dir, **overrides))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "its linear weights in 4 bits (nf4, packed in uint8 storage" in result.stdout + result.stderr
    losses = LaunchedRun(result, output_dir).losses()
    assert len(losses) == 4 and losses[-1] < losses[0]
    script = (
        "import sys, torch; from peft import PeftModel; from safetensors.torch import load_file; "
        "from transformers import AutoModelForCausalLM; ref = load_file(sys.argv[3]); "
        "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2]).eval(); "
        "torch.no_grad().__enter__(); logits = model(input_ids=ref['input_ids']).logits; "
        "print((logits - ref['logits']).abs().max().item())"
    )
    args = [str(base), str(output_dir / "final"), str(output_dir / "final_logits.safetensors")]
    reloaded = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert reloaded.returncode == 0, reloaded.stderr[-3000:]
    assert float(reloaded.stdout.split()[-1]) <= 1e-4
    with pytest.raises(FinetuneError, match="is stored quantized .* no weights to fold the adapter into"):
        export_checkpoint(output_dir, tmp_path / "merged", merge=True)


def test_resuming_with_other_adapter_settings_names_the_setting(lora_run):
    """A checkpoint's adapters resume only under the settings they trained with: fewer target modules would
    drop trained adapters silently, another rank or method would fail deep inside the load."""
    from finetune.model.adapters import check_resume_adapters

    step_4 = lora_run.output_dir / "checkpoints" / "step_4"
    same = load_recipe(lora_run.output_dir / "recipe.yaml").peft
    check_resume_adapters(step_4, same)
    check_resume_adapters(step_4, dataclasses.replace(same, dropout=0.1))  # changes no tensor: allowed
    for change, message in (
        ({"target_modules": ["q_proj", "v_proj"]}, r"peft.target_modules=\['q_proj', 'v_proj'\] \(the checkpoint"),
        ({"r": 4}, r"peft.r=4 \(the checkpoint trained with 8\)"),
        ({"method": "dora"}, r"peft.method=dora \(the checkpoint trained with lora\)"),
    ):
        with pytest.raises(FinetuneError, match=message):
            check_resume_adapters(step_4, dataclasses.replace(same, **change))


def test_an_export_never_writes_over_the_base_or_another_run(lora_run, one_process_run, demo_assets, tmp_path):
    base = shutil.copytree(demo_assets / "base", tmp_path / "base")
    checkpoint = shutil.copytree(lora_run.output_dir / "checkpoints" / "step_8", tmp_path / "step_8")
    adapter_config = checkpoint / MODEL_FILES / "adapter_config.json"
    adapter_config.write_text(
        json.dumps({**json.loads(adapter_config.read_text()), "base_model_name_or_path": str(base)})
    )
    before = sorted(p.name for p in base.iterdir())
    with pytest.raises(FinetuneError, match="is the base model the adapter is merged into"):
        export_checkpoint(checkpoint, base, merge=True, overwrite=True)
    assert sorted(p.name for p in base.iterdir()) == before
    with pytest.raises(FinetuneError, match="is a training run's output folder .* which --overwrite would delete"):
        export_checkpoint(checkpoint, one_process_run.output_dir, overwrite=True)
    assert (one_process_run.output_dir / "checkpoints" / "step_8").is_dir()


def test_qlora_under_bf16_compute_packs_its_weights_in_bf16_whatever_model_dtype(demo_assets, tmp_path):
    """One key turns QLoRA on: with fp32 master weights (model.dtype float32) under a bf16 accelerate config, the
    4-bit weights are packed in bf16 storage, which FSDP's bf16 cast leaves as it is, and the run trains."""
    overrides = {**QLORA, "train.max_steps": 2, "checkpoint.save_every_steps": 0, "output.export": "false"}
    result = launch(
        "fsdp2_full_shard.yaml", recipe_overrides(demo_assets, tmp_path / "out", **overrides),
        launch_args=("--mixed_precision", "bf16"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    assert "its linear weights in 4 bits (nf4, packed in bfloat16 storage" in log and "compute in bfloat16" in log
    losses = LaunchedRun(result, tmp_path / "out").losses()
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_a_qlora_run_prints_only_its_own_lines(qlora_run):
    """An adapter run imports PEFT and bitsandbytes, whose import-time chatter stays out of the log."""
    from test_log import ALLOWED, log_lines

    allowed = [*ALLOWED, r"adapters: ", r"exported \S+ with the adapter merged to \S+$"]
    unexpected = [line for line in log_lines(qlora_run) if not any(re.match(p, line) for p in allowed)]
    assert unexpected == [], "\n".join(unexpected[:20])
