"""The varlen attention path (finetune/engine/attention.py) against the block-mask SDPA reference: same loss and
gradients on packed rows of several architectures; the traps of packed rows under the other kernels; the
models it refuses; and, where a GPU is present, torch's FlashAttention varlen kernel against the reference."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from finetune.data import IGNORE
from finetune.engine import attention
from finetune.objectives.loss import batch_loss, model_inputs
from finetune.plan.flops import model_flops

SMALL = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
ARCHITECTURES = {
    "llama": transformers.LlamaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2),  # grouped-query
    "qwen2": transformers.Qwen2Config(**SMALL, intermediate_size=64, num_key_value_heads=2),
    "mistral": transformers.MistralConfig(**SMALL, intermediate_size=64, num_key_value_heads=1, sliding_window=None),
    "gpt2": transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0
    ),
}


def packed_batch(lengths: list[list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of packed samples of the given lengths (each row's lengths sum to the same row length)."""
    generator = torch.Generator().manual_seed(seed)
    width = sum(lengths[0])
    input_ids = torch.randint(0, 96, (len(lengths), width), generator=generator)
    targets = input_ids.roll(-1, dims=1)
    targets[torch.rand(len(lengths), width, generator=generator) < 0.25] = IGNORE
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return {"input_ids": input_ids, "target_ids": targets, "position_ids": position_ids}


def pair(architecture: str, implementation: str = attention.NAME, dtype=torch.float32):
    """The reference model (SDPA, block mask from position_ids) and a copy running `implementation`."""
    attention.register()
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        ARCHITECTURES[architecture], attn_implementation="sdpa", dtype=dtype
    )
    other = copy.deepcopy(reference)
    other.set_attn_implementation(implementation)
    return reference, other


def loss_and_grads(model, batch, path="full_logits"):
    model.zero_grad()
    result = batch_loss(model, batch, path)
    result.total.backward()
    return result, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("path", ["full_logits", "chunked"])
def test_varlen_equals_the_block_mask_reference(architecture, path):
    reference, varlen = pair(architecture)
    batch = packed_batch([[7, 11, 6], [24], [1, 13, 10]])  # a one-token sample; a row that is one sample
    expected, expected_grads = loss_and_grads(reference, batch, path)
    got, grads = loss_and_grads(varlen, batch, path)
    torch.testing.assert_close(got.total, expected.total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.per_row, expected.per_row, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_varlen_differs_from_attention_across_samples():
    """The equality above cannot come from both sides ignoring the boundaries: without them, the loss moves."""
    reference, varlen = pair("llama")
    batch = packed_batch([[7, 11, 6], [10, 14]])
    unpacked = {**batch, "position_ids": torch.arange(24).repeat(2, 1)}
    losses = [batch_loss(varlen, b, "full_logits").total for b in (batch, unpacked)]
    assert not torch.allclose(*losses)


def test_varlen_inputs_are_one_row_with_the_boundaries():
    _, varlen = pair("llama")
    inputs = model_inputs(varlen, packed_batch([[7, 11, 6], [24]]))
    assert inputs["input_ids"].shape == (1, 48)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 7, 18, 24, 48]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == 24


def test_padded_rows_take_causal_attention_per_row():
    """Padded batches (one sample a row, padded on the right) need no boundaries: same loss as SDPA's mask."""
    reference, varlen = pair("llama")
    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    targets = input_ids.roll(-1, dims=1).masked_fill(mask == 0, IGNORE)
    batch = {"input_ids": input_ids, "target_ids": targets, "attention_mask": mask}
    torch.testing.assert_close(
        batch_loss(varlen, batch, "full_logits").total, batch_loss(reference, batch, "full_logits").total
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"attention_dropout": 0.1}, "dropout"),
        ({"sliding_window": 16}, "sliding window"),
    ],
)
def test_varlen_refuses_what_its_kernels_cannot_do(change, reason):
    config = transformers.MistralConfig(**SMALL, intermediate_size=64, num_key_value_heads=1, **change)
    assert reason in attention.unsupported(config)
    assert attention.unsupported(ARCHITECTURES["llama"]) is None


def test_under_autocast_varlen_picks_its_kernel_for_the_autocast_dtype(monkeypatch):
    """accelerate without FSDP (single_gpu.yaml) runs float32 parameters under autocast: the rotary embedding
    then returns float32 queries and keys beside bf16 values. The kernel is chosen, and runs, in the autocast
    dtype, as SDPA's inputs are cast: on an H200 the float32 fallback took 3x the step time and memory."""
    asked = []
    monkeypatch.setattr(attention, "_flash_runs", lambda device, dtype: asked.append(dtype) or False)
    reference, varlen = pair("llama")
    batch = packed_batch([[5, 7], [12]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = batch_loss(varlen, batch, "full_logits").total
        expected = batch_loss(reference, batch, "full_logits").total
    assert asked == [torch.bfloat16] * 2  # one call per layer
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=0)  # bf16: two kernels, two roundings


def test_batch_flops_count_each_samples_attention():
    """Packed rows: attention FLOPs grow with the sum of squared sample lengths, not rows x length squared."""
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"])
    packed = packed_batch([[8, 16], [24]])
    parameters = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    layers, width = 2, 32
    expected = 6 * parameters * 48 + 6 * layers * width * (8**2 + 16**2 + 24**2)
    assert model_flops(model).batch(packed, num_tokens=48).item() == pytest.approx(expected)


@pytest.mark.cuda
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
def test_flash_varlen_kernel_matches_the_reference_on_gpu(architecture):
    reference, varlen = pair(architecture, dtype=torch.bfloat16)
    reference, varlen = reference.cuda(), varlen.cuda()
    assert attention.kernel(torch.device("cuda"), torch.bfloat16) == "torch varlen_attn (FlashAttention)"
    batch = {k: v.cuda() for k, v in packed_batch([[70, 110, 60], [240], [1, 130, 109]]).items()}
    expected, expected_grads = loss_and_grads(reference, batch)
    got, grads = loss_and_grads(varlen, batch)
    torch.testing.assert_close(got.total, expected.total, rtol=1e-2, atol=0)  # bf16: two kernels, two roundings
    for name, grad in grads.items():
        reference = expected_grads[name].float()
        assert (grad.float() - reference).norm() <= 2e-2 * reference.norm(), name
