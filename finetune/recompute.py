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
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from accelerate import Accelerator

    from finetune.config import RecipeConfig

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


_RECOMPUTED = {
    "none": "every activation kept, nothing recomputed",
    "full": "each decoder layer keeps its input and recomputes its forward in backward",
    "selective": "decoder layers keep matmul and attention outputs and recompute the rest",
}


def recompute_policy(recipe: RecipeConfig, accelerator: Accelerator) -> tuple[Policy, str | None]:
    """The recipe's activation-checkpointing policy, `auto` resolved by the plan's estimate against this
    device's memory (`finetune.plan.cheapest_policy`), and its log line (None for none, asked for)."""
    requested = recipe.train.recompute
    if requested != "auto":
        return (
            requested,
            f"activation checkpointing: {requested} ({_RECOMPUTED[requested]})" if requested != "none" else None,
        )
    # Imported here: the planner imports the model module, which imports this one.
    from finetune.distributed import running_launch
    from finetune.plan import cheapest_policy, estimate, model_shape, planned_model

    cuda = accelerator.device.type == "cuda"
    memory = torch.cuda.get_device_properties(accelerator.device).total_memory if cuda else None
    launch = running_launch(accelerator)
    policy = cheapest_policy(estimate(model_shape(planned_model(recipe)), recipe, launch, launch.strategy), memory)
    reason = (
        f"the first that the plan fits in {memory / 2**30:.1f} GiB"
        if memory
        else f"{accelerator.device.type}: no device memory to fit"
    )
    return policy, f"activation checkpointing: auto, so {policy} ({reason}; {_RECOMPUTED[policy]})"
