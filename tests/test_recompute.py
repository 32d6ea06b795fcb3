"""Activation checkpointing policies: `selective` and `full` give the gradients of `none`, dropout
included (the random state is replayed), and differ in what backward recomputes: full redoes every
matmul of the forward, selective none of them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from test_loss import ARCHITECTURES, packed_batch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.config import ModelConfig
from finetune.engine import recompute
from finetune.engine.recompute import checkpoint_kwargs, offload_layer_inputs
from finetune.model.loading import load_model
from finetune.objectives.loss import batch_loss

MODELS = {
    "llama": ARCHITECTURES["llama"],
    "gpt2-dropout": transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4),  # dropout 0.1
}


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def gradients_and_backward_matmuls(model: torch.nn.Module, policy: str) -> tuple[list[torch.Tensor], int]:
    model = copy.deepcopy(model)
    if policy != "none":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(policy))
    model.train()
    torch.manual_seed(7)  # the dropout masks of the forward
    loss = batch_loss(model, packed_batch(), "full_logits").total
    with CountMatmuls() as counter:
        loss.backward()
    return [p.grad for p in model.parameters()], counter.count


@pytest.mark.parametrize("name", MODELS)
def test_checkpointing_policies_give_the_gradients_of_none(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name])
    reference, plain_matmuls = gradients_and_backward_matmuls(model, "none")
    recomputed = {}
    for policy in ("selective", "full"):
        grads, recomputed[policy] = gradients_and_backward_matmuls(model, policy)
        for got, expected in zip(grads, reference, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    # full reruns each layer's forward matmuls in backward; selective kept their outputs.
    assert recomputed["selective"] == plain_matmuls < recomputed["full"]


def test_the_recipe_policy_reaches_the_model(demo_assets):
    from finetune.config import TrainConfig

    for value, policy in (
        (False, "none"),
        ("none", "none"),
        (True, "full"),
        ("full", "full"),
        ("selective", "selective"),
    ):
        assert TrainConfig(micro_batch_size=1, activation_checkpointing=value).recompute == policy
        model = load_model(ModelConfig(name_or_path=str(demo_assets / "base")), policy)
        assert model.is_activation_checkpointing == (policy != "none")
        if policy != "none":
            layer_checkpoint = model.model.layers[0]._gradient_checkpointing_func
            assert ("context_fn" in layer_checkpoint.keywords) == (policy == "selective")


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_offloaded_layer_inputs_give_the_gradients_of_kept_ones(policy, monkeypatch):
    """train.activation_offload: each checkpointed layer's input goes to host memory and comes back for its
    backward (on CPU a copy, so the round trip is taken); the gradients are those of the run that keeps it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS["llama"])
    reference, _ = gradients_and_backward_matmuls(model, policy)
    offloaded = copy.deepcopy(model)
    offloaded.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(policy))
    assert offload_layer_inputs(offloaded) == MODELS["llama"].num_hidden_layers
    moved = []
    to_host = recompute._to_host
    monkeypatch.setattr(recompute, "_to_host", lambda tensor: (moved.append(tensor.shape), to_host(tensor))[1])
    grads, _ = gradients_and_backward_matmuls(offloaded, "none")  # already checkpointed, and offloading
    hidden = MODELS["llama"].hidden_size
    assert len(moved) == MODELS["llama"].num_hidden_layers and all(shape[-1] == hidden for shape in moved)
    for got, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_activation_offload_needs_checkpointing():
    from finetune.config import TrainConfig

    errors = TrainConfig(micro_batch_size=1, max_steps=1, activation_offload=True).errors()
    assert any("set it to full or selective" in error for error in errors)
    assert not TrainConfig(
        micro_batch_size=1, max_steps=1, activation_offload=True, activation_checkpointing="full"
    ).errors()


@pytest.mark.cuda
def test_offloaded_layer_inputs_leave_the_gpu_and_give_the_same_gradients():
    """On a GPU the layer inputs go to pinned host memory: after the forward the device holds less, by about one
    input per layer, and the gradients are those of the run that keeps them."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).cuda()
    tokens = torch.randint(0, 256, (1, 4096), device="cuda")

    def run(offload: bool) -> tuple[int, list[torch.Tensor]]:
        copy_ = copy.deepcopy(model)
        copy_.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs("full"))
        if offload:
            offload_layer_inputs(copy_)
        copy_.train()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        hidden = copy_.model(input_ids=tokens).last_hidden_state
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        hidden.float().square().mean().backward()
        return held, [p.grad for p in copy_.parameters()]

    kept, reference = run(False)
    offloaded, grads = run(True)
    layer_input = 4096 * 512 * 4
    assert kept - offloaded >= (config.num_hidden_layers - 1) * layer_input
    for got, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, expected)  # attention's GPU backward may add in another order


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("name", MODELS)
def test_tiled_mlps_give_the_gradients_of_whole_ones(name, policy, monkeypatch):
    """train.mlp_tile_tokens: each layer's MLP over tiles of 5 tokens (2 rows of 24: 10 tiles, one partial), each
    recomputed in backward, inside a checkpointed layer or not. Without dropout the gradients are the untiled
    ones; with dropout (GPT-2's MLP) each tile draws its own mask, and the recomputation replays it: the gradients
    are those of the same tiles computed without recomputation."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name])
    tiled = copy.deepcopy(model)
    assert recompute.tile_mlps(tiled, 5) == model.config.num_hidden_layers
    if name == "gpt2-dropout":  # the reference: the same tiles, kept rather than recomputed
        model = copy.deepcopy(tiled)
        monkeypatch.setattr(recompute, "checkpoint", lambda function, *args, use_reentrant, **kwargs: function(*args))
        reference, _ = gradients_and_backward_matmuls(model, policy)
        monkeypatch.undo()
    else:
        reference, _ = gradients_and_backward_matmuls(model, policy)
    calls = []
    checkpointed = recompute.checkpoint
    monkeypatch.setattr(
        recompute, "checkpoint", lambda *args, **kwargs: (calls.append(1), checkpointed(*args, **kwargs))[1]
    )
    grads, _ = gradients_and_backward_matmuls(tiled, policy)
    forwards = 2 if policy == "full" else 1  # a checkpointed layer runs its forward again in backward
    assert len(calls) == math.ceil(2 * 24 / 5) * model.config.num_hidden_layers * forwards
    for got, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


_LAYER_PEAK = """
import sys, torch, transformers
from finetune.engine import recompute
from finetune.objectives.loss import batch_loss
from finetune.engine.memory import _peak, _reset_peak
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=96, hidden_size=512, intermediate_size=2048, num_hidden_layers=1,
    num_attention_heads=8, num_key_value_heads=2)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
if sys.argv[1] != "whole":
    recompute.tile_mlps(model, int(sys.argv[1]))
ids = torch.randint(0, 96, (1, 8192))
batch = {"input_ids": ids, "target_ids": torch.roll(ids, -1, 1)}
batch_loss(model, {key: value[:, :1024] for key, value in batch.items()}, "chunked").total.backward()  # lazy setup
before = _reset_peak(torch.device("cpu"))
batch_loss(model, batch, "chunked").total.backward()
print(_peak(torch.device("cpu")) - before)
"""


def test_tiled_mlps_halve_a_layers_peak_at_long_rows():
    """A Llama layer (hidden 512, MLP 2048, the 4x of Llama's shapes) on a row of 8,192 tokens, forward and
    backward, each measured in a process of its own by the memory probe's CPU measure (the resident-set
    high-water mark over what the process held before): tiles of 1,024 tokens at least halve the peak (measured:
    0.47x, 2026-11-28: 268 MB against 567 MB, the rest of the layer's being what is left)."""
    import os
    import subprocess
    import sys

    peaks = {}
    for tiles in ("whole", "1024"):
        command = [sys.executable, "-c", _LAYER_PEAK, tiles]
        # Every allocation over 64 KiB mapped and unmapped on its own: the resident set follows what is alive, not
        # what glibc's heap kept from earlier (a heap it reuses would hide a peak, one it keeps would inflate it).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        peaks[tiles] = int(result.stdout.split()[-1])
    assert peaks["1024"] <= 0.5 * peaks["whole"], peaks


def test_the_plan_counts_mlp_tiles_and_says_which_pieces_lengthen_a_row():
    """`finetune plan`'s longest row for Llama-3.1-8B (full fine-tuning) on one 80 GB GPU: with ALST's pieces (MLP
    tiles, the chunked loss, checkpointed layers' inputs and the sharded state offloaded) over 500K tokens, ALST's
    measured length on one H100; without the tiles well short of it; the report names what it used."""
    from pathlib import Path

    from finetune.config import load_recipe
    from finetune.engine.launch import read_launch
    from finetune.plan.shape import model_shape, planned_model
    from finetune.plan.verdict import longest_fitting_length, plan

    repo = Path(__file__).resolve().parent.parent
    pieces = ["train.micro_batch_size=1", "train.global_batch_size=null", "train.activation_checkpointing=full",
              "train.activation_offload=true"]  # fmt: skip
    launch = read_launch(repo / "accelerate_configs" / "fsdp2_offload.yaml", 1, 1)
    lengths = {}
    for tiles in ("null", "8192"):
        recipe = load_recipe(
            repo / "recipes" / "llama" / "llama-3.1-8b.yaml", [*pieces, f"train.mlp_tile_tokens={tiles}"]
        )
        lengths[tiles] = longest_fitting_length(model_shape(planned_model(recipe)), recipe, launch, 80 * 10**9)
    assert lengths["8192"] >= 500_000 > 1.5 * lengths["null"], lengths
    report = plan(recipe, launch, 80 * 10**9)
    # Memory's figure, given beside the 131,072 positions Llama-3.1-8B attends, which cap the line.
    assert (
        f"fits: 131,072 tokens, the model's positions (memory alone would allow {lengths['8192']:,}; with MLP tiles "
        "of 8,192 tokens, chunked loss, activation checkpointing, " in report
    )
    assert "layer inputs offloaded, parameters and optimizer state offloaded)" in report
