"""Dropout in a model that trains: where it is, off where an objective compares two forwards (preference tuning,
online RL, reward models), and replayed exactly where activation checkpointing recomputes a layer."""

from __future__ import annotations

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import PreTrainedModel

from finetune.engine.recompute import checkpoint_kwargs
from finetune.errors import FinetuneError

_DROPOUT_MODULES = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)  # fmt: skip


def checkpoint_dropout_exactly(plugin: FullyShardedDataParallelPlugin, model: PreTrainedModel) -> str | None:
    """Under FSDP2 activation checkpointing, make a model that trains with dropout recompute its exact forward.

    accelerate wraps each layer in `checkpoint_wrapper(preserve_rng_state=False)`: the recompute in
    backward draws new dropout masks, so the gradients would belong to another forward than the one
    that gave the loss, and nothing would say so. For such a model the same layers are checkpointed
    by transformers' gradient checkpointing instead, which replays the random state. Returns a line
    for the log saying so, or None when the model needs nothing (no dropout, or no checkpointing).
    """
    if plugin.fsdp_version != 2 or not plugin.activation_checkpointing:
        return None
    dropout = dropout_site(model)
    if dropout is None:
        return None
    offload = getattr(plugin, "activation_checkpointing_offload", False)
    if offload or not model.supports_gradient_checkpointing:
        raise FinetuneError(
            f"the model trains with dropout ({dropout}), which accelerate's FSDP2 activation checkpointing "
            "recomputes with new random masks, so gradients would not match the loss; transformers' gradient "
            f"checkpointing, which replays them, cannot stand in here ({type(model).__name__}, offload "
            f"{offload}): set fsdp_activation_checkpointing: false"
        )
    plugin.activation_checkpointing = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs("full"))
    return (
        f"activation checkpointing: the model trains with dropout ({dropout}), so its layers are checkpointed "
        "by transformers, which replays the dropout masks, not by accelerate's FSDP2 wrapper, which draws new ones"
    )


def disable_dropout(model: torch.nn.Module) -> str | None:
    """Set every dropout of `model` to 0 (its modules' and its attention's), as preference tuning needs: the
    policy's forward and the reference's must agree at the first step. Returns what was on, or None."""
    found = dropout_site(model) if isinstance(model, PreTrainedModel) else None
    for module in model.modules():
        if isinstance(module, _DROPOUT_MODULES):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # read by attention kernels in training
            module.attention_dropout = 0.0
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "attention_dropout", 0.0):
            config.attention_dropout = 0.0
    return found


def dropout_site(model: PreTrainedModel) -> str | None:
    """Where `model` applies dropout while training (the first such module, or its attention's), or None."""
    for name, module in model.named_modules():
        if isinstance(module, _DROPOUT_MODULES) and module.p > 0:
            return f"{name} p={module.p}"
    attention_dropout = getattr(model.config, "attention_dropout", 0.0)  # applied inside the attention kernel
    return f"attention_dropout={attention_dropout}" if attention_dropout else None
