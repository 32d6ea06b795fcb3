"""Attention over packed rows by their sample boundaries: `model.attn_implementation: varlen`.

A packed row holds several samples, told apart by `position_ids` restarting at 0. Under `sdpa`,
transformers turns those restarts into a dense block-causal mask (rows x 1 x S x S booleans): SDPA
cannot take its flash kernel with a mask, and it computes every tile, masked or not. The varlen path
hands the kernel the boundaries instead: the batch's rows become one sequence (`model_inputs`), its
cumulative sample lengths (`cu_seq_lens`) travel to every attention layer as keyword arguments, and
each sample attends causally to itself alone.

The kernel is torch's own FlashAttention entry point, `torch.nn.attention.varlen.varlen_attn`, on a
GPU in fp16/bf16 (torch >= 2.10); elsewhere (CPU, fp32, an older torch) the same function runs SDPA
once per sample: the same math, a loop instead of one launch, and what the tests compare with the
block-mask reference. Batches without `position_ids` (padded rows: one sample per row, padding on
the right) need no boundaries: causal attention never lets a token see the padding after it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

NAME = "varlen"
BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

_sequence_group: dist.ProcessGroup | None = None
"""Under sequence parallelism (`finetune.engine.sequence`), the processes a row is split over; None otherwise."""


def current_sequence_group() -> dist.ProcessGroup | None:
    """The group rows are split over (`split_rows_over`), or None."""
    return _sequence_group


def rows_split() -> bool:
    """Whether rows are split over a sequence group (their attention flattens them, not `loss.model_inputs`)."""
    return _sequence_group is not None


def split_rows_over(group: dist.ProcessGroup | None) -> None:
    """Make every varlen attention call attend over rows split along the sequence over `group` (set once by the
    build, before any forward; None: rows whole on each process)."""
    global _sequence_group
    _sequence_group = group


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent). Registering no mask function
    is deliberate: transformers then builds no mask at all for this implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


def unsupported(config: Any) -> str | None:
    """Why a model with this config cannot run the varlen path, or None. Its kernels know causal attention
    over whole samples, without dropout, sliding windows or logit soft-capping."""
    config = config.get_text_config()
    if getattr(config, "attention_dropout", 0.0):
        return f"its attention applies dropout (attention_dropout={config.attention_dropout})"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"it attends within a sliding window of {window} tokens"
    if getattr(config, "attn_logit_softcapping", None):
        return "it soft-caps its attention logits"
    if not getattr(config, "is_causal", True):
        return "its attention is not causal"
    return None


def kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel the varlen path runs for tensors of this device and dtype (the log says it)."""
    return "torch varlen_attn (FlashAttention)" if _flash_runs(device, dtype) else "SDPA once per sample"


def _flash_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return _varlen_attn() is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def boundaries(position_ids: torch.Tensor, cu: torch.Tensor | None = None) -> dict[str, Any]:
    """The keyword arguments that carry the sample boundaries of packed rows of `position_ids` (rows x
    length) once flattened into one: a sample starts wherever the positions restart at 0 (`cu`, when the
    collator found them on the host: finding them on a GPU would stall the host). The longest sample is
    given as the row length, which bounds it: the kernel only sizes its grid by it, and a number that
    never changes keeps compiled layers from recompiling for each batch.

    How many samples a batch packs changes every batch, and so does `cu`'s length: it is marked dynamic, or
    compiled layers recompile for each new count. accelerate's launcher compiles with `dynamic=False` (its
    `--dynamo_use_dynamic` is off by default), which turns off torch's own promotion of a changing size to a
    symbolic one: on an H200 every step recompiled (2.2 s a step against eager's 0.36-0.69 s)."""
    cu = cu if cu is not None else cumulative_lengths(position_ids)
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    longest = position_ids.shape[-1]
    return dict(zip(BOUNDARY_KWARGS, (cu, cu, longest, longest), strict=True))


def cumulative_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Where each sample of packed rows starts once they are flattened into one (its positions restart at 0),
    and their end: the cumulative sample lengths from 0, as varlen kernels take them."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    end = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, end]).to(torch.int32)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (batch, heads, seq, dim), key/value (batch,
    kv_heads, seq, dim); returns (batch, seq, heads, dim) and no attention weights."""
    if dropout:
        raise ValueError("varlen attention has no dropout; set attention_dropout to 0 or use sdpa")
    if _sequence_group is not None:
        return _over_sequence_group(query, key, value, scaling, _sequence_group, kwargs), None
    return _whole_rows(query, key, value, scaling, kwargs), None


def _whole_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, kwargs: dict[str, Any]
) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # one sample per row
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()
    # (rows, heads, length, dim) -> (tokens, heads, dim), the layout of varlen kernels: the rows flattened, in the
    # order of `cu` (one row already, unless the rows were split over a sequence group).
    rows = query.shape[0]
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))
    if torch.is_autocast_enabled(q.device.type):
        # Under autocast (one GPU without FSDP: float32 parameters, a float32 residual stream) the rotary
        # embedding returns float32 queries and keys beside bf16 values. Autocast casts SDPA's inputs to its
        # dtype; so does this path, or no varlen kernel takes them and the fallback holds float32 scores.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if _flash_runs(q.device, q.dtype):
        out = _flash(q, k, v, cu, kwargs["max_length_q"], scaling)
    else:
        out = _per_sample(q, k, v, cu, scaling, gqa)
    return out.unflatten(0, (rows, -1))


def _over_sequence_group(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    group: dist.ProcessGroup,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Attention over rows whose sequence is split over `group`: heads exchanged for the sequence, attention over
    whole rows (their samples apart, by the rows' global boundaries), and back."""
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % size:
        # Fewer key/value heads than processes (or not a multiple of them): every query head takes its own copy,
        # so that each process's share of query heads arrives with the key/value heads it reads.
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
    if kwargs.get("cu_seq_lens_q") is not None:
        # The model gave the slice's length as the longest sample; the rows are whole now.
        kwargs = kwargs | {"max_length_q": query.shape[2], "max_length_k": query.shape[2]}
    return heads_to_sequence(_whole_rows(query, key, value, scaling, kwargs), group)


def _per_sample(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scaling: float | None, gqa: bool
) -> torch.Tensor:
    """SDPA over each sample in turn: where no varlen kernel runs (CPUs; on a GPU, fp32), so the boundaries are
    read on the host."""
    bounds = cu.tolist()
    outs = [
        F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        ).transpose(0, 1)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scaling: float | None
) -> torch.Tensor:
    varlen_attn = _varlen_attn()
    extra: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if _takes_gqa():
            extra["enable_gqa"] = True
        else:  # torch 2.10/2.11: the kernel wants as many key/value heads as query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # window (-1, 0): no limit to the left, none to the right, i.e. causal.
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), **extra)


@functools.cache
def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


@functools.cache
def _takes_gqa() -> bool:
    """Whether torch's varlen kernel shares key/value heads itself (asked once, not in every layer's call)."""
    return "enable_gqa" in inspect.signature(_varlen_attn()).parameters


def sequence_to_heads(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(rows, heads, slice, dim) on each of the group's processes -> (rows, heads / N, N x slice, dim): every
    process gives each peer that peer's share of the heads, and receives the whole row's sequence for its own."""
    size = dist.get_world_size(group)
    rows, heads, length, dim = tensor.shape
    send = tensor.reshape(rows, size, heads // size, length, dim).transpose(0, 1).contiguous()
    received = all_to_all_single_autograd(send, None, None, group)
    # (N peers = sequence slices, rows, heads / N, slice, dim) -> (rows, heads / N, N x slice, dim)
    return received.permute(1, 2, 0, 3, 4).reshape(rows, heads // size, size * length, dim)


def heads_to_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `sequence_to_heads` on an attention output laid out (rows, N x slice, heads / N, dim):
    returns (rows, slice, heads, dim), every head of this process's slice."""
    size = dist.get_world_size(group)
    rows, total, heads, dim = tensor.shape
    length = total // size
    send = tensor.reshape(rows, size, length, heads, dim).transpose(0, 1).contiguous()
    received = all_to_all_single_autograd(send, None, None, group)
    # (N peers = head shares, rows, slice, heads / N, dim) -> (rows, slice, N x heads / N, dim)
    return received.permute(1, 2, 0, 3, 4).reshape(rows, length, size * heads, dim)
