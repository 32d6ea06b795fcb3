"""Activation checkpointing policies: which activations a decoder layer keeps for backward (the choice of one
for `auto` is the planner's: `finetune.plan.verdict.recompute_policy`).

- `none`: every activation is kept (fastest, most memory).
- `full`: each layer keeps only its input and recomputes its whole forward in backward.
- `selective`: each layer keeps the outputs of its matrix multiplications and of attention, and
  recomputes the rest (norms, rotary embeddings, activation functions, elementwise products): the
  ops that are cheap to redo but whose outputs are as large as the matmuls'. The per-op policy of
  torchtitan's selective checkpointing, through torch's `create_selective_checkpoint_contexts`.

Checkpointing goes through transformers' gradient checkpointing (non-reentrant `torch.utils.checkpoint`),
which replays the random state, so a model trained with dropout recomputes the same masks.

`train.activation_offload` moves what a checkpointed layer keeps (its input) to host memory
(`offload_layer_inputs`), so that the activations left on the device no longer grow with the layer count.

`train.mlp_tile_tokens` computes each decoder layer's MLP over tiles of the sequence, each tile checkpointed
(`tile_mlps`): the MLP's intermediate activations (gate, up, their product: several times the hidden width per
token, the largest a layer makes) exist for one tile at a time, in forward and in backward, which is what bounds
a layer's peak at long rows (ALST's sequence-tiled MLP, Arctic Long Sequence Training).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

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


def offload_layer_inputs(model: torch.nn.Module) -> int:
    """Keep the inputs of `model`'s checkpointed layers in pinned host memory until their backward (returns how
    many layers). torch's checkpoint saves a region's inputs as saved tensors, through the saved-tensor hooks in
    force when it is called: the hooks here are in force for that call alone (inside the region its own hooks
    take over), so only the layer inputs move, not the parameters or anything a layer recomputes. The copies are
    asynchronous, ordered on the stream that computes: the memory a copy reads is reused only after it.

    transformers 5.23's `activation_checkpointing_enable(offload=True)` is this design through torch's
    `save_on_cpu`, and on a machine without a GPU it asks for pinned memory and fails; this one copies there
    instead, so that the path the tests prove on CPU is the one GPUs run."""
    layers = 0
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(module, GradientCheckpointingLayer) and checkpoint is not None and module.gradient_checkpointing:
            module._gradient_checkpointing_func = functools.partial(_inputs_on_host, checkpoint)
            layers += 1
    return layers


def _inputs_on_host(checkpoint: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
        return checkpoint(function, *args, **kwargs)


def _to_host(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    if tensor.device.type == "cpu":  # nothing to free: a copy all the same, so that CPU runs take the path
        return tensor.device, tensor.clone()
    host = torch.empty_like(tensor, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _to_device(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, host = packed
    return host.to(device, non_blocking=True)


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """Compute the MLP of each of `model`'s decoder layers over tiles of `tile_tokens` tokens along the sequence,
    each tile checkpointed (non-reentrant `torch.utils.checkpoint`: its forward again in backward, the random state
    replayed). Returns how many layers. An MLP acts on each token alone, so tiles give the untiled outputs; and
    autograd runs one tile's backward to its end before the next (the later tile's nodes come first), so one
    tile's intermediates exist at a time. The parameters keep their names: the MLP's forward is wrapped in place,
    as accelerate's hooks wrap a module's."""
    layers = 0
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(module, GradientCheckpointingLayer) and isinstance(mlp, torch.nn.Module):
            mlp.forward = functools.partial(_tiled_forward, mlp, tile_tokens)
            layers += 1
    return layers


def _tiled_forward(mlp: torch.nn.Module, tile_tokens: int, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    forward = functools.partial(type(mlp).forward, mlp)
    tokens = hidden.reshape(-1, hidden.shape[-1])  # the rows' tokens in one run: each tile a contiguous view
    if not torch.is_grad_enabled() or tokens.shape[0] <= tile_tokens:  # nothing kept for backward, or one tile
        return forward(hidden, *args, **kwargs)
    tiles = tokens.split(tile_tokens)
    out = torch.cat([checkpoint(forward, tile, *args, use_reentrant=False, **kwargs) for tile in tiles])
    return out.view(*hidden.shape[:-1], out.shape[-1])
