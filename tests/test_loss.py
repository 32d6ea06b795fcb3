"""The chunked loss (logits only where there are targets, projection + cross-entropy a chunk at a time)
against the reference (full logits in fp32, `F.cross_entropy`): same losses and gradients in fp32, on
packed rows of several architectures; and the models it must not take."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from finetune.data import IGNORE
from finetune.objectives import loss as loss_module
from finetune.objectives.loss import batch_loss, chunked_loss_unsupported

SMALL = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
ARCHITECTURES = {
    "llama": transformers.LlamaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2),
    "qwen2": transformers.Qwen2Config(**SMALL, intermediate_size=64, num_key_value_heads=2),
    "mistral": transformers.MistralConfig(**SMALL, intermediate_size=64, num_key_value_heads=2),
    "phi3": transformers.Phi3Config(**SMALL, intermediate_size=64, pad_token_id=0),
    "gpt2": transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0
    ),  # tied head
    # a mixture of experts with a vocabulary of 201,088 in its real size: the model the chunked head matters most for
    "gpt_oss": transformers.GptOssConfig(
        **SMALL,
        intermediate_size=32,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows of two packed samples each (positions restart), a third of the targets ignored."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 96, (2, 24), generator=generator)
    targets = torch.roll(input_ids, -1, dims=1)
    targets[torch.rand(2, 24, generator=generator) < 0.33] = IGNORE
    targets[:, -1] = IGNORE
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    return {"input_ids": input_ids, "target_ids": targets, "position_ids": position_ids}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunked_loss_equals_the_full_logits_reference(architecture, monkeypatch):
    monkeypatch.setitem(loss_module._CHUNK_BYTES, "cpu", 4 * 96 * 5)  # 5 rows a chunk: several chunks, one partial
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[architecture])
    chunked = copy.deepcopy(reference)
    assert chunked_loss_unsupported(chunked) is None
    batch = packed_batch()
    expected, got = batch_loss(reference, batch, "full_logits"), batch_loss(chunked, batch, "chunked")
    torch.testing.assert_close(got.total, expected.total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.per_row, expected.per_row, rtol=1e-6, atol=1e-6)
    (expected.total * 0.37).backward()  # any scale reaches the gradients as it does through the reference
    (got.total * 0.37).backward()
    for (name, a), b in zip(reference.named_parameters(), chunked.parameters(), strict=True):
        scale = max(1.0, a.grad.abs().max().item())  # fp32 rounding grows with the gradient (gpt-oss: up to 3.6)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    with torch.no_grad():  # evaluation: the same losses without gradients
        torch.testing.assert_close(batch_loss(chunked, batch, "chunked").per_row, expected.per_row)
    assert chunked(input_ids=batch["input_ids"]).logits.shape == (2, 24, 96)  # the head is itself again


def test_the_chunked_projection_with_a_bias_and_in_bf16():
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        hidden = torch.randn(13, 16, generator=generator).to(dtype).requires_grad_()
        head = torch.nn.Linear(16, 40).to(dtype)
        targets = torch.randint(0, 40, (13,), generator=generator)
        targets[[2, 7]] = IGNORE
        losses = F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")
        expected = torch.autograd.grad(losses, [hidden, head.weight, head.bias])
        total, _ = loss_module._LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, True)
        got = torch.autograd.grad(total, [hidden, head.weight, head.bias])
        torch.testing.assert_close(total, losses, rtol=tolerance, atol=tolerance)
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_under_autocast_the_chunked_head_multiplies_in_the_autocast_dtype(monkeypatch):
    """accelerate without FSDP (single_gpu.yaml): float32 weights under bf16 autocast. The chunked head's
    gradient products run in bf16 as the reference's backward does (an in-place float32 addmm_ is not
    autocast: on an H200 it ran as a SIMT SGEMM); the loss and gradients match the reference's to bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Float32Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                self.count += all(a.dtype == torch.float32 for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    monkeypatch.setitem(loss_module._CHUNK_BYTES, "cpu", 4 * 96 * 5)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, generator=generator).requires_grad_()
    head = torch.nn.Linear(16, 96, bias=False)
    targets = torch.randint(0, 96, (13,), generator=generator)
    targets[[2, 7]] = IGNORE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")
        expected = torch.autograd.grad(losses, [hidden, head.weight])
        with Float32Matmuls() as matmuls:
            total, _ = loss_module._LinearCrossEntropy.apply(hidden, head.weight, None, targets, True)
        got = torch.autograd.grad(total, [hidden, head.weight])
    assert matmuls.count == 0
    torch.testing.assert_close(total, losses, rtol=1e-2, atol=0)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).norm() <= 1e-2 * b.norm()


def test_models_whose_logits_are_more_than_a_projection_keep_the_reference():
    gemma2 = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(**SMALL, intermediate_size=64, head_dim=8, final_logit_softcapping=30.0)
    )
    assert "model type gemma2" in chunked_loss_unsupported(gemma2)
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(
        transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"]),
        LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
    )
    assert "output layer is adapted or quantized (peft.tuners.lora" in chunked_loss_unsupported(adapted)
    plain = get_peft_model(
        transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"]),
        LoraConfig(r=4, target_modules=["q_proj"]),
    )
    assert chunked_loss_unsupported(plain) is None


@pytest.mark.multiprocess
def test_under_fsdp2_the_chunked_loss_trains_as_the_reference(fsdp2_run, demo_assets, tmp_path):
    """Two processes over gloo, FSDP2 full shard (the head's parameters gathered by the root's hooks, as
    the loss runs inside the model's forward): the default chunked loss and train.loss_path=full_logits give
    the same training and evaluation losses, and the log says which ran. The reference run also takes
    the varlen attention path (one launch for two levers: it differs from the default run in both, so an
    error in either shows), asks for `auto` activation checkpointing, which is none on CPU, and records
    steps 3-4 with the profiler (which must not change what is computed)."""
    from helpers import LaunchedRun, launch, recipe_overrides

    output_dir = tmp_path / "out"
    result = launch(
        "fsdp2_full_shard.yaml",
        recipe_overrides(
            demo_assets,
            output_dir,
            **{
                "train.loss_path": "full_logits",
                "model.attn_implementation": "varlen",
                "train.activation_checkpointing": "auto",
                "train.profile_steps": "[3,4]",
            },
        ),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = LaunchedRun(result, output_dir)
    assert f"profile: steps 3-4 recorded to {output_dir / 'profile'}" in reference.log
    for rank in (0, 1):  # every process's trace holds the two steps, spans named by the run's step numbers
        trace = json.loads((output_dir / "profile" / f"rank{rank}.trace.json").read_text())
        spans = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("step ")}
        assert spans == {"step 3", "step 4"}
        assert "aten::mm" in (output_dir / "profile" / f"rank{rank}.txt").read_text()
    assert sorted(p.name for p in (output_dir / "profile").iterdir()) == [
        "rank0.trace.json", "rank0.txt", "rank1.trace.json", "rank1.txt"
    ]  # fmt: skip
    assert "loss: chunked (logits at target positions only" in fsdp2_run.log
    assert "loss: full logits in fp32 (train.loss_path=full_logits)" in reference.log
    assert "attention: sdpa (packed rows: block-causal mask" in fsdp2_run.log
    assert "attention: varlen, packed rows by their sample boundaries (SDPA once per sample)" in reference.log
    assert "activation checkpointing: auto, so none (cpu: no device memory to fit;" in reference.log
    assert len(fsdp2_run.losses()) == len(reference.losses()) == 16
    torch.testing.assert_close(fsdp2_run.losses(), reference.losses(), rtol=1e-5, atol=1e-6)
    evaluations = [[m["eval_loss"] for m in run.metrics() if "eval_loss" in m] for run in (fsdp2_run, reference)]
    torch.testing.assert_close(*evaluations, rtol=1e-5, atol=1e-6)


def test_packed_rows_become_one_row_for_flash_attention(monkeypatch):
    """transformers finds packed samples' boundaries from position_ids for flash attention only in a batch of
    one row; with more, every row would attend across its samples. Packed rows go in as one row then, and
    give the losses of the rows (checked under SDPA, which reads one row's restarts the same way)."""
    from finetune.objectives.loss import _flash_attention, model_inputs

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"])
    batch = packed_batch()
    assert not _flash_attention(model.config._attn_implementation)
    assert model_inputs(model, batch)["input_ids"].shape == (2, 24)
    assert _flash_attention("flash_attention_2") and _flash_attention("flash_attention_3")
    expected = {path: batch_loss(model, batch, path).per_row for path in ("full_logits", "chunked")}
    monkeypatch.setattr(loss_module, "_flash_attention", lambda implementation: True)
    flat = model_inputs(model, batch)
    assert flat["input_ids"].shape == (1, 48)
    assert torch.equal(flat["position_ids"], batch["position_ids"].reshape(1, -1))
    for path, per_row in expected.items():
        torch.testing.assert_close(batch_loss(model, batch, path).per_row, per_row, rtol=1e-5, atol=1e-5)
    # Padded rows (an attention mask) are left as they are; so is a single row.
    padded = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    assert model_inputs(model, padded)["input_ids"].shape == (2, 24)


def test_packed_batches_carry_no_attention_mask():
    """An all-ones 2-D attention mask would turn transformers' packed-sample detection off (attention across
    samples); packed batches give position_ids alone."""
    from finetune.data.pack import collate_packed

    rows = [{"input_ids": [1, 2, 3], "target_ids": [2, 3, -100], "position_ids": [0, 1, 0], "num_tokens": 3}] * 2
    assert "attention_mask" not in collate_packed(rows)
