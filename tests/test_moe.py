"""Mixtures of experts: exports in the hub's layout, active-parameter FLOPs (finetune.model.family), fp32 routing and
the balancing loss (finetune.model.routing)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import DEMO_RECIPE, REPO, TINY, LaunchedRun, launch, recipe_overrides, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_export import max_logits_difference
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.errors import FinetuneError
from finetune.export import merge as merge_module
from finetune.model.family import active_parameters, experts_of
from finetune.model.routing import (
    BalancingLoss,
    balancing_coefficient,
    check_grouped_mm_shapes,
    real_tokens,
    route_in_fp32,
    routers,
)
from finetune.plan.flops import model_flops
from finetune.storage.checkpoint import MARKER, MODEL_FILES

# The families transformers converts between the hub's per-expert tensors and its fused ones, and gpt-oss
# (published fused: kept as it is).
FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "phimoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
            "qwen3_next", "minimax", "hunyuan_v1_moe", "gpt_oss"]  # fmt: skip


def saved_pretrained(model, folder: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for `model`: every tensor of every safetensors file, by name."""
    model.save_pretrained(folder)
    tensors = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


def sharded_checkpoint(model, folder: Path) -> Path:
    """`model` as a SHARDED checkpoint of `finetune train`: its state through torch.distributed.checkpoint (what
    accelerate's save_state writes for FSDP) and its config; the launched run below writes one for real."""
    checkpoint = folder / "checkpoints" / "step_1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint / "pytorch_model_fsdp_0", no_dist=True)
    model.config.save_pretrained(checkpoint / MODEL_FILES)
    (checkpoint / MARKER).write_text("step 1\n")
    return checkpoint


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "export", *map(str, args)], cwd=REPO, capture_output=True, text=True
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_writes_what_save_pretrained_writes(model_type, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    expected = saved_pretrained(model, tmp_path / "save_pretrained")
    out = tmp_path / "exported"
    result = export(sharded_checkpoint(model, tmp_path / "run"), out, "--max-shard-size", "20KB")
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    exported = {}
    for filename in sorted(set(index.values())):
        with safe_open(out / filename, "pt") as f:
            exported.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
            assert all(index[key] == filename for key in f.keys())  # noqa: SIM118
    assert sorted(exported) == sorted(expected) == sorted(index)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    if model_type != "gpt_oss":
        assert not any(name.endswith("gate_up_proj") for name in exported)  # per expert, as the hub stores them
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(ids, use_cache=False).logits, model.eval()(ids, use_cache=False).logits)


@pytest.mark.parametrize(
    "model_type, total, active",
    [("qwen3_moe", 4, 2), ("gpt_oss", 4, 2), ("mixtral", 4, 2), ("deepseek_v3", 4, 2), ("llama", None, None)],
)
def test_active_parameters_count_the_routed_experts_a_token_goes_through(model_type, total, active):
    config = tiny_config(model_type) if model_type != "llama" else AutoConfig.for_model("llama", **{
        k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads")})  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = experts_of(config)
    assert (experts.total, experts.active) == (total, active) if total else experts is None
    everything = sum(p.numel() for p in model.parameters())
    routed = 0
    for layer in model.model.layers:  # by hand: each MoE layer's routed experts, whatever the family calls them
        moe = getattr(layer, "mlp", None)
        if moe is not None and hasattr(moe, "experts"):
            routed += sum(p.numel() for p in moe.experts.parameters())
    assert (routed > 0) == (total is not None)
    fraction = active / total if total else 1
    assert active_parameters(model) == pytest.approx(everything - routed + routed * fraction)


@pytest.mark.parametrize(
    ("model_type", "attention"), [("qwen3_moe", "sdpa"), ("mixtral", "sdpa"), ("gpt_oss", "eager")]
)
def test_plan_counts_the_activations_of_routed_experts_and_of_eager_attention(model_type, attention):
    """`finetune plan`'s activation estimate against the bytes a forward saves for backward: a mixture of experts'
    MLP is as wide as the top k experts a token goes through (plus its routed copies), and eager attention (which
    gpt-oss needs) keeps each layer's n x n scores, which dwarf the rest at a few hundred tokens."""
    from finetune.plan.estimates import activation_bytes
    from finetune.plan.shape import model_shape

    torch.manual_seed(0)
    config = tiny_config(model_type, hidden_size=128, head_dim=32, moe_intermediate_size=64, vocab_size=256)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    rows, length = 2, 256
    ids = torch.randint(0, 256, (rows, length))
    storages: dict[int, int] = {}

    def saved(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter) and not isinstance(tensor._base, torch.nn.Parameter):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda tensor: tensor):
        logits = model(ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    shape = model_shape(model)
    top_k = 2 * (64 if model_type != "mixtral" else config.intermediate_size)  # routers, biases: a few more
    assert shape.intermediate == pytest.approx(top_k, rel=0.05)
    scores = rows * length * length * shape.heads if attention == "eager" else 0
    estimate = activation_bytes(shape, rows * length, 4, "none", loss="full_logits", scores=scores)
    assert estimate == pytest.approx(sum(storages.values()), rel=0.25)
    if scores:  # without the scores the estimate falls outside the tolerance
        assert activation_bytes(shape, rows * length, 4, "none", loss="full_logits") < 0.75 * sum(storages.values())


def test_model_flops_of_qwen3_30b_a3b_and_gpt_oss_20b_count_their_active_parameters():
    """6 N per token with N counted by hand from the published shapes: the attention, norms, router and
    head whole, top_k of the experts (Qwen3-30B-A3B: 8 of 128; gpt-oss-20b: 4 of 32, with biases and sinks)."""
    qwen = AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    )  # fmt: skip
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128  # q, k, v, o, q/k norms
    layer = attention + 2 * 2048 + 128 * 2048 + 8 * 3 * 2048 * 768  # + norms, router, 8 experts
    qwen_active = 48 * layer + 151936 * 2048 + 2048  # + head, final norm
    gpt_oss = AutoConfig.for_model(  # gpt-oss-20b: the defaults (gpt-oss-120b's) with 24 layers of 32 experts
        "gpt_oss", num_hidden_layers=24, num_local_experts=32, layer_types=["sliding_attention", "full_attention"] * 12
    )
    attention = (2880 * 4096 + 4096) + 2 * (2880 * 512 + 512) + (4096 * 2880 + 2880) + 64  # with biases, sinks
    expert = (2880 * 5760 + 5760) + (2880 * 2880 + 2880)  # gate_up and down projections with biases
    layer = attention + 2 * 2880 + (32 * 2880 + 32) + 4 * expert
    gpt_oss_active = 24 * layer + 201088 * 2880 + 2880
    for config, active in ((qwen, qwen_active), (gpt_oss, gpt_oss_active)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert model_flops(model).per_token == 6 * active
    assert round(qwen_active / 1e9, 2) == 3.04 and round(gpt_oss_active / 1e9, 2) == 3.61


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_balancing_term_is_the_models_own_over_real_tokens(model_type):
    """The term recorded from a training forward equals the aux_loss transformers computes with
    output_router_logits over the same batch's attention mask; packed rows mask their padding by row_tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    balancing = BalancingLoss(model, coefficient=0.01)
    ids = torch.randint(0, 128, (2, 10))
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    expected = model(ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    packed = {"input_ids": ids, "row_tokens": torch.tensor([10, 6])}  # no mask: positions past row_tokens are padding
    with balancing.recording():
        model(ids, attention_mask=mask, use_cache=False)
    assert torch.equal(real_tokens(packed), mask)
    term = balancing.take(packed)
    assert term.item() == pytest.approx(expected.item(), rel=1e-6) and term.requires_grad
    with torch.no_grad(), balancing.recording():  # a reference's or an evaluation's forward: nothing recorded
        model(ids, use_cache=False)
    assert balancing._logits == []


def test_balancing_loss_is_refused_for_a_dense_model_and_defaults_to_the_models_coefficient():
    assert balancing_coefficient(tiny_config("qwen3_moe"), None) == 0.001
    assert balancing_coefficient(tiny_config("qwen3_moe"), 0.0) == 0.0
    assert balancing_coefficient(tiny_config("deepseek_v3"), None) == 0.0  # routes without one
    with pytest.raises(FinetuneError, match="routes without a balancing loss; remove train.router_aux_loss_coef"):
        balancing_coefficient(tiny_config("deepseek_v3"), 0.01)
    with pytest.raises(FinetuneError, match="llama model is dense"):
        balancing_coefficient(AutoConfig.for_model("llama"), 0.01)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "mixtral"])  # DeepSeek's routers cast by themselves
def test_under_bf16_fsdp2_routers_compute_in_fp32(model_type):
    """One process, a 1-rank gloo group, the mixed-precision policy training uses: the routers' logits and routing
    weights are fp32 while the rest computes in bf16 (and were bf16 before route_in_fp32), and the routers'
    parameters still receive gradients."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from finetune.engine.accelerator import _mixed_precision_policy
    from finetune.engine.processes import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        policy = _mixed_precision_policy(2, "bf16", torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        outputs: list = []
        for router in routers(model):
            router.register_forward_hook(lambda module, inputs, output: outputs.append(output))
        ids = torch.randint(0, 128, (2, 10))
        model(ids, use_cache=False)
        assert outputs and all(o[0].dtype == torch.bfloat16 for o in outputs)  # logits in bf16 before
        outputs.clear()
        assert route_in_fp32(model) == len(routers(model))
        logits = model(ids, use_cache=False).logits
        assert logits.dtype == torch.bfloat16
        floating = [t for o in outputs for t in o if t.is_floating_point()]  # logits, and weights where separate
        assert floating and all(t.dtype == torch.float32 for t in floating)
        logits.float().sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for r in routers(model) for p in r.parameters())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_bases(tmp_path_factory, demo_assets) -> dict[str, Path]:
    """Tiny Qwen3-MoE, Mixtral and gpt-oss models (top 2 of 4 experts; of 3 for Qwen3-MoE, which FSDP2 shards
    unevenly on 2 ranks: 2 experts and 1 plus padding) with the demo's tokenizer, saved as hub models are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    bases = {}
    for model_type in ("qwen3_moe", "mixtral", "gpt_oss"):
        torch.manual_seed(0)
        config = tiny_config(
            model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256,
            **({"num_experts": 3, "num_local_experts": 3} if model_type == "qwen3_moe" else {}),
        )  # fmt: skip
        bases[model_type] = tmp_path_factory.mktemp(model_type) / "base"
        AutoModelForCausalLM.from_config(config).save_pretrained(bases[model_type])
        tokenizer.save_pretrained(bases[model_type])
    return bases


MOE_SETTINGS = {"train.max_steps": 6, "train.eval_every_steps": 0, "data.eval_path": "null"}
# gpt-oss: eager attention (its sinks), rows padded (its mask ignores packed rows' positions: check_packing).
GPT_OSS = {"model.attn_implementation": "eager", "data.packing": "false"}
WRAP = {"qwen3_moe": "Qwen3MoeDecoderLayer", "mixtral": "MixtralDecoderLayer", "gpt_oss": "GptOssDecoderLayer"}


def _moe_run(
    tmp_path_factory, assets: Path, base: Path, name: str, num_processes: int, sp: int = 1, **extra
) -> LaunchedRun:
    output_dir = tmp_path_factory.mktemp(name) / "out"
    values = {"model.name_or_path": base, "train.micro_batch_size": 4, **MOE_SETTINGS, **extra}
    wrap = ("--fsdp_transformer_layer_cls_to_wrap", WRAP[json.loads((base / "config.json").read_text())["model_type"]])
    overrides = recipe_overrides(assets, output_dir, **values)
    config = "sequence_parallel.yaml" if sp > 1 else "fsdp2_full_shard.yaml"
    sequence = ("--parallelism_config_sp_size", str(sp)) if sp > 1 else ()
    result = launch(config, overrides, num_processes=num_processes, launch_args=(*wrap, *sequence))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, demo_assets, moe_bases) -> LaunchedRun:
    """Qwen3-MoE (3 experts: uneven shards), full fine-tuning, 2 processes x 2 micro-batches of 4 rows, balancing
    loss at the model's 0.001."""
    return _moe_run(
        tmp_path_factory, demo_assets, moe_bases["qwen3_moe"], "moe2", 2, **{"train.gradient_accumulation_steps": 2}
    )


@pytest.fixture(scope="module")
def moe_one_process_run(tmp_path_factory, demo_assets, moe_bases) -> LaunchedRun:
    """The same global batches as moe_run, split into the same 4 micro-batches, on 1 process."""
    return _moe_run(
        tmp_path_factory, demo_assets, moe_bases["qwen3_moe"], "moe1", 1, **{"train.gradient_accumulation_steps": 4}
    )


@pytest.mark.multiprocess
def test_moe_run_exports_per_expert_tensors_that_give_the_trained_logits(moe_run):
    final = moe_run.output_dir / "final"
    with safe_open(final / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.2.down_proj.weight" in names
    assert not any("gate_up_proj" in name for name in names)
    assert max_logits_difference(moe_run.output_dir, final) <= 1e-5
    assert "experts: 2 of 3 per token (grouped_mm); routers in fp32; balancing loss x0.001 (the model's" in moe_run.log


@pytest.mark.multiprocess
def test_balancing_loss_is_normalized_like_the_loss_on_any_process_count(moe_run, moe_one_process_run):
    """1 process x 4 micro-batches and 2 x 2 train the same: losses, balancing terms and weights within 1e-5, with
    the 3 experts of each layer sharded 2 and 1 over the ranks."""
    two, one = moe_run.metrics(), moe_one_process_run.metrics()
    steps = [m for m in two if "aux_loss" in m]
    assert len(steps) == 6
    assert all(2.0 <= m["aux_loss"] < 4.0 for m in steps)  # top_k (2) at perfect balance, more when unbalanced
    # each layer's busiest expert over the mean: 1 at perfect balance, 1.5 (3 experts / top 2) at the worst
    assert all(1.0 <= m[f"expert_load/{layer}"] <= 1.5 for m in steps for layer in (0, 1))
    for a, b in zip(steps, [m for m in one if "aux_loss" in m], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-5)
    trained = [load_file(run.output_dir / "final" / "model.safetensors") for run in (moe_run, moe_one_process_run)]
    for name, tensor in trained[0].items():
        assert torch.allclose(tensor, trained[1][name], atol=1e-5), name


@pytest.mark.multiprocess
def test_rows_split_over_a_sequence_group_balance_experts_over_whole_rows(
    tmp_path_factory, demo_assets, moe_bases, moe_one_process_run
):
    """sp=2: each process routes half of every row's tokens; the balancing term is the whole rows' (the group's
    counts and probabilities added up), so losses, balancing terms and weights are those of 1 process."""
    split = _moe_run(
        tmp_path_factory, demo_assets, moe_bases["qwen3_moe"], "moe_sp2", 2, sp=2,
        **{"train.gradient_accumulation_steps": 4, "model.attn_implementation": "varlen"},
    )  # fmt: skip
    assert "rows split over sequence groups of 2" in split.log
    steps = [m for m in split.metrics() if "aux_loss" in m]
    for a, b in zip(steps, [m for m in moe_one_process_run.metrics() if "aux_loss" in m], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-5)
        assert a["expert_load/0"] == pytest.approx(b["expert_load/0"], abs=1e-5)
    trained = [load_file(run.output_dir / "final" / "model.safetensors") for run in (split, moe_one_process_run)]
    for name, tensor in trained[0].items():
        assert torch.allclose(tensor, trained[1][name], atol=1e-5), name


@pytest.mark.multiprocess
def test_lora_on_an_moe_model_merges_into_the_hub_layout(tmp_path_factory, demo_assets, moe_bases):
    """Mixtral: the hub calls its MoE blocks block_sparse_moe and its experts w1/w2/w3; adapters on its linear layers
    and on every fused expert weight (sharded by expert over 2 processes) train, and the merged export is written
    under the hub's names, from the base's own files, and gives the trained model's logits."""
    run = _moe_run(
        tmp_path_factory, demo_assets, moe_bases["mixtral"], "moe_lora", 2,
        **{"peft.r": 8, "peft.target_modules": "[all-linear]", "peft.target_experts": "true",
           "output.export_merged": "true"},
    )  # fmt: skip
    assert "; 4 fused expert weights adapted per expert" in run.log
    saved = json.loads((run.output_dir / "final" / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == [
        f"model.layers.{n}.mlp.experts.{p}" for n in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]
    merged = run.output_dir / "final_merged"
    with safe_open(merged / "model.safetensors", "pt") as f:
        names = set(f.keys())
    with safe_open(moe_bases["mixtral"] / "model.safetensors", "pt") as f:
        assert names == set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert max_logits_difference(run.output_dir, merged) <= 1e-4


def test_expert_shapes_grouped_mm_cannot_take_are_refused_with_the_fix():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", moe_intermediate_size=36))
    check_grouped_mm_shapes(model, torch.float32)  # 36 x 4 bytes: a multiple of 16
    with pytest.raises(FinetuneError, match=r"8 elements in bfloat16 \(36 is not\); set model.experts_implementation"):
        check_grouped_mm_shapes(model, torch.bfloat16)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):  # what the refusal spares the user
        model(ids, use_cache=False)
    model.set_experts_implementation("batched_mm")  # what model.experts_implementation=batched_mm loads
    assert model(ids, use_cache=False).logits.isfinite().all()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_all_linear_adapts_linear_layers_and_leaves_routers_and_experts_alone(model_type):
    from finetune.config import PeftConfig
    from finetune.model.adapters import add_adapters

    adapted = add_adapters(AutoModelForCausalLM.from_config(tiny_config(model_type)), PeftConfig())
    layers = {name.split(".lora_A")[0].split("layers.1.")[-1] for name, _ in adapted.named_parameters()
              if "lora_A" in name and "layers.1." in name}  # fmt: skip
    expected = {f"self_attn.{p}_proj" for p in "qkvo"}
    if model_type == "qwen2_moe":  # its shared expert is a dense MLP every token goes through, with a linear gate
        expected |= {f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")} | {"mlp.shared_expert_gate"}
    assert layers == expected
    assert not adapted.peft_config["default"].target_parameters


@pytest.mark.parametrize(
    "model, setting, fragment",
    [
        (
            "qwen3_moe",
            "peft.quantization=nf4",
            "peft.quantization=nf4 quantizes linear layers only, and this qwen3_moe",
        ),
        ("dense", "train.router_aux_loss_coef=0.01", "the llama model is dense; remove train.router_aux_loss_coef"),
        ("mixtral", "train.mlp_tile_tokens=64", "routes its tokens to experts; unset train.mlp_tile_tokens"),
    ],
)
def test_moe_settings_a_model_cannot_take_are_refused_before_loading(
    model, setting, fragment, tmp_path, demo_assets, moe_bases
):
    from test_errors import assert_user_error, run_cli

    base = moe_bases.get(model, demo_assets / "base")
    overrides = recipe_overrides(demo_assets, tmp_path / "out", **{"model.name_or_path": base})
    result = run_cli("train", str(DEMO_RECIPE), *overrides, setting)
    assert_user_error(result, fragment)
    assert not (tmp_path / "out").exists()


def stored_in_mxfp4(base: Path, folder: Path) -> Path:
    """`base` (a gpt-oss) as its hub checkpoints are stored: each fused expert weight as MXFP4 blocks (two 4-bit
    floats a byte, 32 to a block) and one power-of-two scale a block, `quantization_config` saying so. The codes are
    random: what they stand for is what transformers dequantizes them to."""
    shutil.copytree(base, folder)
    tensors = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        blocks = (experts, outputs, inputs // 32)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (*blocks, 16), generator=generator, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 128, blocks, generator=generator, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.multiprocess
def test_gpt_oss_trains_from_mxfp4_with_eager_attention_and_exports_plain_weights(
    tmp_path_factory, demo_assets, moe_bases
):
    """gpt-oss: its heads add learned sinks, which transformers' sdpa path lacks (refused before loading, naming
    what runs); its hub experts are MXFP4, dequantized on load; with eager attention it trains on 2 processes and
    exports plain weights under its fused names, without the quantization (transformers' own save_pretrained of
    such a model writes them under the MXFP4 names, which no loader reads as weights)."""
    from test_errors import assert_user_error, run_cli

    base = stored_in_mxfp4(moe_bases["gpt_oss"], tmp_path_factory.mktemp("mxfp4") / "base")
    overrides = recipe_overrides(demo_assets, tmp_path_factory.mktemp("refused") / "out")
    result = run_cli("train", str(DEMO_RECIPE), *overrides, f"model.name_or_path={base}")
    assert_user_error(result, "transformers has no sdpa path for GptOssForCausalLM; set model.attn_implementation")
    run = _moe_run(tmp_path_factory, demo_assets, base, "gpt_oss", 2, **GPT_OSS)
    final = run.output_dir / "final"
    with safe_open(final / "model.safetensors", "pt") as f, safe_open(base / "model.safetensors", "pt") as hub:
        names = set(f.keys())
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in set(hub.keys())  # noqa: SIM118
    with safe_open(moe_bases["gpt_oss"] / "model.safetensors", "pt") as plain:
        assert names == set(plain.keys())  # noqa: SIM118
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    assert max_logits_difference(run.output_dir, final) <= 1e-5
    assert "experts: 2 of 4 per token (grouped_mm); routers in fp32; balancing loss x0.001" in run.log


# ---- LoRA on the routed experts (peft.target_experts: PEFT's target_parameters on the fused expert weights).


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_expert_adapters_merge_into_the_hub_layout_as_peft_merges_them(model_type, tmp_path):
    """Adapters on every fused expert weight (and attention): the merge written in the base's hub layout equals
    PEFT's merge_and_unload saved by save_pretrained, tensor for tensor, and computes the adapted model's logits."""
    from peft import get_peft_model_state_dict

    from finetune.config import PeftConfig
    from finetune.export.merge import ExpertUpdates, MergedWeights, model_weight_files
    from finetune.export.weight_files import SafetensorsWeights
    from finetune.model.adapters import add_adapters
    from finetune.model.family import HubLayout
    from finetune.model.loading import meta_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    base.save_pretrained(tmp_path / "base")
    adapted = add_adapters(copy.deepcopy(base), PeftConfig(r=4, target_modules=["q_proj"], target_experts=True))
    with torch.no_grad():  # as if trained
        for param in adapted.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    fused = [n for n, p in base.named_parameters() if p.ndim == 3]
    assert sorted(adapted.peft_config["default"].target_parameters) == sorted(fused) and len(fused) == 4
    adapter, config = get_peft_model_state_dict(adapted), adapted.peft_config["default"].to_dict()

    meta = meta_model(base.config)
    experts = ExpertUpdates(meta, config, adapter)
    assert len(experts.parts) == 4 and not any("experts" in key for key in adapter)  # the rest: attention's
    hub = HubLayout.of(meta)
    if hub is not None:
        adapter = {merge_module._hub_key(hub, key): tensor for key, tensor in adapter.items()}
    experts.in_layout(hub)
    merged = MergedWeights(SafetensorsWeights(model_weight_files(tmp_path / "base")), adapter, config, set(),
                           experts=experts)  # fmt: skip
    ours = {name: torch.empty(shape) for name, shape in merged.shapes.items()}
    merged.read_into(ours)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        trained = adapted(input_ids=ids).logits
        reference = saved_pretrained(adapted.merge_and_unload(), tmp_path / "peft")
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "peft").eval()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - trained).abs().max().item() <= 1e-5


def test_adapters_merge_onto_an_mxfp4_base_as_onto_its_dequantized_weights(moe_bases, tmp_path):
    """gpt-oss's hub files hold its experts in MXFP4: a merged export reads them as training loaded them
    (transformers' dequantization, under the fused names) and folds the adapter in, as PEFT's merge_and_unload does
    on the dequantized model; the export's config has no quantization_config."""
    from peft import get_peft_model_state_dict
    from transformers import Mxfp4Config

    from finetune.config import PeftConfig
    from finetune.export.merge import ExpertUpdates, MergedWeights, _base_weights
    from finetune.model.adapters import add_adapters
    from finetune.model.loading import meta_model

    folder = stored_in_mxfp4(moe_bases["gpt_oss"], tmp_path / "mxfp4")
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=torch.float32).eval()  # fmt: skip
    adapted = add_adapters(base, PeftConfig(r=4, target_modules=["q_proj"], target_experts=True))
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained
        for param in adapted.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    adapter, config = get_peft_model_state_dict(adapted), adapted.peft_config["default"].to_dict()
    meta = meta_model(adapted.get_base_model().config)
    experts = ExpertUpdates(meta, config, adapter)
    experts.in_layout(None)  # published fused: no conversion
    merged = MergedWeights(_base_weights(str(folder), None), adapter, config, set(), experts=experts)
    assert not any(name.endswith(("_blocks", "_scales")) for name in merged.shapes)
    ours = {name: torch.empty(shape) for name, shape in merged.shapes.items()}
    merged.read_into(ours)
    with torch.no_grad():
        reference = adapted.merge_and_unload().state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_gpt_oss_lora_from_mxfp4_exports_a_plain_merged_model(tmp_path_factory, demo_assets, moe_bases):
    """The gpt-oss recipe's shape, launched: LoRA on attention and on one layer's experts (`target_parameters`, as
    OpenAI's cookbook picks layers) of an MXFP4 base; the merged export holds plain weights under the fused names,
    no quantization_config, and gives the trained model's logits."""
    base = stored_in_mxfp4(moe_bases["gpt_oss"], tmp_path_factory.mktemp("mxfp4_lora") / "base")
    run = _moe_run(
        tmp_path_factory, demo_assets, base, "gpt_oss_lora", 1,
        **GPT_OSS, **{"peft.r": 8, "peft.target_modules": "[all-linear]",
           "peft.target_parameters": "[1.mlp.experts.gate_up_proj,1.mlp.experts.down_proj]",
           "output.export_merged": "true"},
    )  # fmt: skip
    assert "; 2 fused expert weights adapted per expert" in run.log
    assert "loss: chunked" in run.log  # its head is a plain projection: its 201,088 logits are never held whole
    assert (
        "MXFP4 inference on CPU" not in run.result.stderr
    )  # transformers' note on the dequantizing finetune asked for
    merged = run.output_dir / "final_merged"
    with (
        safe_open(merged / "model.safetensors", "pt") as f,
        safe_open(moe_bases["gpt_oss"] / "model.safetensors", "pt") as plain,
    ):
        assert set(f.keys()) == set(plain.keys())  # noqa: SIM118
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    assert max_logits_difference(run.output_dir, merged) <= 1e-4


def test_packing_is_refused_where_the_model_builds_its_mask_without_the_rows_positions(tmp_path):
    """gpt-oss (like OPT, Bloom, Falcon and MPT) builds its causal mask without `position_ids`: a packed row's second
    sample attends to the first (its logits differ from the sample's alone), so packing under a mask-based attention
    is refused before loading, naming the fix; models that pass them (Llama, Qwen3-MoE) pack exactly."""
    from finetune.config import ModelConfig
    from finetune.model.loading import check_packing, packed_mask_ignores_positions

    first, second = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 9))
    row, positions = torch.cat([first, second], 1), torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    for model_type, ignores in (("gpt_oss", True), ("opt", True), ("qwen3_moe", False), ("llama", False)):
        torch.manual_seed(0)
        config = tiny_config(model_type)
        assert packed_mask_ignores_positions(config) is ignores, model_type
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            alone = model(second, use_cache=False).logits
            packed = model(row, position_ids=positions, use_cache=False).logits[:, 7:]
        assert ((packed - alone).abs().max().item() > 1e-3) is ignores, model_type
    tiny_config("gpt_oss").save_pretrained(tmp_path / "gpt_oss")
    for attention in ("eager", "sdpa", "flex_attention"):
        with pytest.raises(FinetuneError, match="builds its attention mask without the packed rows' position_ids"):
            check_packing(ModelConfig(name_or_path=str(tmp_path / "gpt_oss"), attn_implementation=attention), True)
    check_packing(ModelConfig(name_or_path=str(tmp_path / "gpt_oss"), attn_implementation="eager"), False)
    check_packing(ModelConfig(name_or_path=str(tmp_path / "gpt_oss"), attn_implementation="flash_attention_2"), True)


def test_expert_adapters_are_refused_where_they_cannot_train():
    from finetune.config import PeftConfig
    from finetune.model.routing import check_experts_recipe

    assert PeftConfig(target_experts=True, method="dora").errors() == [
        "peft.target_experts adapts parameters with LoRA only; set peft.method: lora"
    ]
    assert "set peft.dropout: 0" in PeftConfig(target_parameters=["experts.down_proj"], dropout=0.1).errors()[0]
    with pytest.raises(FinetuneError, match="this llama model is dense; remove peft.target_experts"):
        check_experts_recipe(AutoConfig.for_model("llama"), None, None, "peft.target_experts")
    from finetune.model.adapters import check_adapter_targets

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    with pytest.raises(FinetuneError, match=r"names experts.gate_proj, which .*\(fused expert\) parameters are: mlp"):
        check_adapter_targets(model, PeftConfig(target_parameters=["experts.gate_proj"]))


def test_parameter_adapters_on_a_dense_model_are_refused_before_loading(demo_assets, tmp_path):
    """peft.target_parameters on a dense model would train its 2-D weights, then fail at the merge: refused before
    anything loads or is written, naming the setting."""
    output_dir = tmp_path / "out"
    overrides = recipe_overrides(
        demo_assets, output_dir, **{"peft.r": 4, "peft.target_parameters": "[mlp.down_proj.weight]"}
    )
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "train", str(DEMO_RECIPE), *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "peft.target_parameters adapts the fused expert weights of a mixture of experts, and this llama model "
        "is dense; remove peft.target_parameters" in result.stderr
    )
    assert "Traceback" not in result.stderr and not output_dir.exists()


def test_the_merge_names_its_own_limit_for_parameter_adapters_on_plain_weights(demo_assets):
    """An adapter of an earlier version that adapted a dense model's 2-D weight through target_parameters: the
    merge says it folds only fused expert weights (not that the checkpoint is damaged), before reading weights."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    base = AutoModelForCausalLM.from_pretrained(demo_assets / "base")
    config = {"r": 4, "lora_alpha": 8, "target_modules": [], "target_parameters": ["mlp.down_proj.weight"]}
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(**config, task_type="CAUSAL_LM"))
    adapter = {f"base_model.model.{k.removeprefix('base_model.model.')}": v
               for k, v in get_peft_model_state_dict(adapted).items()}  # fmt: skip
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(base.config)
    with pytest.raises(FinetuneError, match=r"folds such updates only into fused expert weights .* export without"):
        merge_module.ExpertUpdates(meta, config, adapter)
