"""Regional compilation (accelerate's `dynamo_use_regional_compilation`: each repeated decoder layer
compiled in place, before FSDP2 shards it): no graph breaks and no recompiles as packing changes, and
the same training as eager. On CPU the graphs are compiled with `aot_eager` (dynamo's capture and
AOTAutograd's joint graph, eager kernels); the GPU preset `single_node_compiled.yaml` uses inductor."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from accelerate.utils.other import compile_regions_fsdp2
from test_loss import ARCHITECTURES, packed_batch
from torch._dynamo.utils import counters

from finetune.objectives.loss import batch_loss

SHAPES = {
    **{name: ARCHITECTURES[name] for name in ("llama", "qwen2", "mistral")},
    "gpt2": transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0
    ),
}


@pytest.mark.parametrize("name", SHAPES)
def test_regional_compilation_has_no_graph_break_recompiles_nothing_and_trains_as_eager(name):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(SHAPES[name])
    compiled = compile_regions_fsdp2(copy.deepcopy(eager), backend="aot_eager")
    graphs = []
    # Where the packed samples start changes every step; a row of one sample is the unpacked variant.
    for packing in ([10, 14], [5, 19], [24], [3, 8, 13], [24], [12, 12]):
        batch = packed_batch()
        batch["position_ids"] = torch.cat([torch.arange(length) for length in packing]).repeat(2, 1)
        for path in ("chunked", "full_logits"):
            expected, got = batch_loss(eager, batch, path), batch_loss(compiled, batch, path)
            torch.testing.assert_close(got.total, expected.total, rtol=1e-6, atol=1e-6)
            expected.total.backward()
            got.total.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Compiled once for packed rows and once for a row of one sample (no block mask), then reused.
    assert graphs[0] > 0 and graphs[0] == graphs[1] and graphs[2] == graphs[-1] <= graphs[0] + 1, graphs
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


def _block_causal_kernel(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, 0), **_):
    """A stand-in for torch's FlashAttention varlen kernel (CUDA only) with its signature: causal attention
    within each sample of (tokens, heads, dim), from the boundaries tensor alone, so that dynamo traces `cu` into
    the graph as it does the real kernel's custom op (the CPU fallback reads it on the host instead)."""
    token = torch.arange(query.shape[0])
    sample = torch.searchsorted(cu_q[1:].long(), token, right=True)
    mask = (sample[:, None] == sample[None, :]) & (token[:, None] >= token[None, :])
    key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def test_the_gpu_varlen_path_compiled_as_accelerate_launches_it_does_not_recompile_as_sample_counts_change(
    monkeypatch,
):
    """accelerate's launcher compiles with `dynamic=False`; the GPU kernel takes the samples' boundaries as a
    tensor whose length is the batch's sample count. Unless that length is marked dynamic, every new count
    recompiles each layer (an H200 ran 2.2 s a step against eager's 0.36-0.69 s)."""
    from finetune.engine import attention

    monkeypatch.setattr(attention, "_flash_runs", lambda device, dtype: True)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: _block_causal_kernel)
    monkeypatch.setattr(attention, "_takes_gqa", lambda: False)
    attention.register()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = copy.deepcopy(ARCHITECTURES["llama"])  # from_config writes the attention into the config it is given
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="varlen")
    compiled = compile_regions_fsdp2(copy.deepcopy(eager), backend="aot_eager", dynamic=False)
    graphs = []
    for packing in ([10, 14], [5, 19], [3, 8, 13], [2, 2, 20], [1, 1, 1, 21], [24], [12, 12]):
        batch = packed_batch()
        batch["position_ids"] = torch.cat([torch.arange(length) for length in packing]).repeat(2, 1)
        expected, got = batch_loss(eager, batch, "chunked"), batch_loss(compiled, batch, "chunked")
        torch.testing.assert_close(got.total, expected.total, rtol=1e-6, atol=1e-6)
        expected.total.backward()
        got.total.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and len(set(graphs)) == 1, f"recompiled as the sample count changed: {graphs}"
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_regional_compilation_under_fsdp2_and_checkpointing_trains_as_eager(fsdp2_run, demo_assets, tmp_path):
    """Two processes over gloo: FSDP2 full shard with accelerate's activation checkpointing and regional
    compilation gives the eager run's losses."""
    from helpers import LaunchedRun, launch, recipe_overrides

    output_dir = tmp_path / "out"
    flags = ("--fsdp_activation_checkpointing", "true", "--dynamo_backend", "aot_eager",
             "--dynamo_use_regional_compilation")  # fmt: skip
    result = launch("fsdp2_full_shard.yaml", recipe_overrides(demo_assets, output_dir), launch_args=flags)
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = LaunchedRun(result, output_dir)
    assert "compile: aot_eager, regional (" in compiled.log and "(0 modules" not in compiled.log
    torch.testing.assert_close(compiled.losses(), fsdp2_run.losses(), rtol=1e-5, atol=1e-6)


def test_regionally_compiled_shared_rollout_rows_train_as_eager():
    """Online RL's shared rows (a prompt once, its completions after it: `finetune.engine.shared_attention`) through
    compiled layers: no graph break, the eager log-probabilities and gradients, as prompt lengths change."""
    from helpers import tiny_config

    from finetune.data.pack import with_host_indices
    from finetune.data.rollout import shared_rows
    from finetune.engine import shared_attention
    from finetune.objectives.loss import token_logps

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    shared_attention.register()
    eager.set_attn_implementation(shared_attention.NAME)
    compiled = compile_regions_fsdp2(copy.deepcopy(eager), backend="aot_eager")
    for prompt_length in (3, 5, 3):
        rows = with_host_indices(dict(shared_rows([[5] * prompt_length] * 4, [[8, 9, 10], [8, 9], [7], [6]], 2, 0)))
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            logps = token_logps(model, rows, "chunked")
            logps.sum().backward()
            results.append((logps.detach(), [p.grad.clone() for p in model.parameters()]))
        (expected, expected_grads), (got, got_grads) = results
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        for a, b in zip(expected_grads, got_grads, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert not counters["graph_break"], dict(counters["graph_break"])
