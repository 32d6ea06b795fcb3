"""What a model's architecture decides beyond its module names: whether its MLPs are mixtures of experts, the
layout its weights are published in, and the parameters a token goes through.

Dense models and mixtures of experts (MoE) differ in all three. transformers 5 keeps an MoE layer's experts in
memory as fused 3-D tensors (`mlp.experts.gate_up_proj`: experts x 2 intermediate x hidden) and converts the
hub's one-tensor-per-expert files (`mlp.experts.{i}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{i}.w1`)
into them on load; `save_pretrained` converts back. Servers and converters (vLLM, llama.cpp) read only the hub's
names, so an export must be converted back too: `HubLayout` does it with transformers' own reversal, one tensor at
a time. Families published fused (gpt-oss) have no conversion and keep their names.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from finetune.errors import FinetuneError, first_line

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The config keys families use for an MoE layer's routed experts, and for the experts a token goes through.
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# The module holding a layer's routed experts (shared experts, run for every token, have other names).
EXPERTS_MODULE = "experts"


@dataclass(frozen=True)
class Experts:
    """The routed experts of an MoE model's layers."""

    total: int
    """Experts in each MoE layer."""
    active: int
    """Experts each token goes through (the router's top k)."""

    @property
    def active_fraction(self) -> float:
        return self.active / self.total


def experts_of(config: PretrainedConfig) -> Experts | None:
    """The routed experts `config` describes; None for a dense model."""
    config = config.get_text_config()
    total = next((getattr(config, key) for key in _NUM_EXPERTS_KEYS if getattr(config, key, None)), None)
    active = next((getattr(config, key) for key in _TOP_K_KEYS if getattr(config, key, None)), None)
    if not total or not active or total <= 1:
        return None
    return Experts(int(total), int(active))


def is_routed_expert(name: str) -> bool:
    """Whether parameter `name` belongs to a layer's routed experts (`...mlp.experts.gate_up_proj`, or one expert's
    `...experts.3.w1.weight`), not to its router or shared experts."""
    return EXPERTS_MODULE in name.split(".")


def active_parameters(model: torch.nn.Module) -> float:
    """The parameters one token goes through: all of a dense model's; of an MoE model's routed experts, the
    fraction the router picks (top k of the experts), every other parameter (attention, routers, shared experts,
    dense layers, the head) whole. DTensor parameters count their global size."""
    experts = experts_of(model.config)
    fraction = experts.active_fraction if experts is not None else 1.0
    return sum(p.numel() * (fraction if is_routed_expert(n) else 1.0) for n, p in model.named_parameters())


class HubLayout:
    """The names, shapes and values `save_pretrained` writes for a model's in-memory tensors.

    Built from the config alone (a meta-device model: the reversal needs only the model's class and config;
    a model loaded from an already converted folder would record no conversion to revert). Each tensor is
    converted on its own, so an exporter holds one fused tensor at a time, never the whole model.
    """

    def __init__(self, model: torch.nn.Module):
        self.model, self.model_type = model, model.config.model_type
        self.state = model.state_dict()

    @classmethod
    def of(cls, model: torch.nn.Module) -> HubLayout | None:
        """The layout of `model` (built from its config, on the meta device: finetune.model.loading.meta_model); None
        where the hub stores every tensor as the model holds it (dense models, families published fused)."""
        from transformers.core_model_loading import revert_weight_conversion

        layout = cls(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = revert_weight_conversion(layout.model, dict(layout.state))
        if {name: t.shape for name, t in converted.items()} == {name: t.shape for name, t in layout.state.items()}:
            return None
        return layout

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """`tensor` (in-memory name `name`) as the tensors the hub layout stores for it: itself, renamed, or split
        (one fused expert tensor into one tensor per expert and projection). Works on meta tensors too."""
        from transformers.core_model_loading import revert_weight_conversion

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                converted = revert_weight_conversion(self.model, {name: tensor})
        except Exception as exc:  # transformers raises many types from its converters
            raise FinetuneError(
                f"transformers cannot write {name} of a {self.model_type} model in the layout its hub checkpoints "
                f"use ({first_line(exc)}); upgrade transformers, or report the model type to finetune"
            ) from None
        if sum(t.numel() for t in converted.values()) != tensor.numel():
            raise FinetuneError(
                f"transformers' conversion of {name} of a {self.model_type} model to its hub layout needs other "
                "tensors than this one, which an export that writes a shard at a time cannot give it; report the "
                "model type to finetune"
            )
        return converted

    def name(self, name: str) -> str:
        """The hub name of in-memory tensor `name`, which the hub layout stores whole (renamed or not); a name the
        model does not hold is returned as it is (for the caller to refuse)."""
        if name not in self.state:
            return name
        converted = self.convert(name, self.state[name])
        if len(converted) != 1:
            raise FinetuneError(
                f"{name} of a {self.model_type} model is stored as {len(converted)} tensors on the hub, so an "
                "update to it cannot be merged tensor by tensor; export the adapter without --merge"
            )
        return next(iter(converted))

    def groups(self, groups: list[list[str]]) -> list[list[str]]:
        """Tensor-name groups (tied names together, finetune.storage.checkpoint.tensor_names) in hub names: a renamed
        tensor keeps its group, a split one becomes a group per stored tensor."""
        hub: list[list[str]] = []
        for group in groups:
            converted = [list(self.convert(name, self.state[name])) for name in group]
            if len(converted[0]) == 1:
                hub.append([names[0] for names in converted])
            else:
                hub.extend([name] for name in converted[0])
        return hub
