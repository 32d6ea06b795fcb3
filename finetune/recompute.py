"""Activation checkpointing policies: which activations a decoder layer keeps for backward.

- `none`: every activation is kept (fastest, most memory).
- `full`: each layer keeps only its input and recomputes its whole forward in backward.
- `selective`: each layer keeps the outputs of its matrix multiplications and of attention, and
  recomputes the rest (norms, rotary embeddings, activation functions, elementwise products): the
  ops that are cheap to redo but whose outputs are as large as the matmuls'. The per-op policy of
  torchtitan's selective checkpointing, through torch's `create_selective_checkpoint_contexts`.

Checkpointing goes through transformers' gradient checkpointing (non-reentrant `torch.utils.checkpoint`),
which replays the random state, so a model trained with dropout recomputes the same masks.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

Policy = Literal["none", "full", "selective"]

# Outputs worth keeping: what a matmul or an attention kernel produced, each costly to redo.
_SAVED = (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
)  # fmt: skip
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED if hasattr(torch.ops.aten, name))


def _keep_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(policy: Policy) -> dict[str, Any]:
    """Keyword arguments of `torch.utils.checkpoint.checkpoint` for `policy` (not `none`)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
    return kwargs
