"""The shape of a recipe's run, as the planner counts it: the model built on the meta device (no weights, no
memory) to count its parameters exactly and find its wrap units, its adapters and teacher, and what one forward
and one rollout hold (sequences, completions).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from finetune.config import ModelConfig, RecipeConfig
from finetune.engine.launch import Launch
from finetune.model.family import Experts, experts_of, is_routed_expert
from finetune.model.loading import (
    check_model_path,
    load_model_config,
    meta_model,
    positions_of,
)
from finetune.model.score_head import as_reward_model


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, read from a model config."""

    name: str
    parameters: int
    largest_unit: int
    """Parameters of the largest wrap unit (a decoder layer), all-gathered at once under FSDP."""
    layers: int
    hidden: int
    intermediate: int
    """The MLP width a token goes through: of a mixture of experts, its top k routed experts' (and shared ones')."""
    kv_hidden: int
    vocab: int
    trainable: int
    """Parameters that get gradients and optimizer state: all of them, or the adapters' (fp32)."""
    heads: int = 0
    head_dim: int = 0
    routed: int = 0
    """Of a mixture of experts, the routed experts a token goes through (its top k); 0 for a dense model."""
    adapters: bool = False
    quantizable: int = 0
    """Frozen weights of linear layers other than the output head: what QLoRA stores in 4 bits."""
    teacher: int = 0
    """A distillation teacher's parameters (frozen, sharded as the model's), and its width: 0 without one."""
    teacher_hidden: int = 0
    teacher_table: bool = False
    """distill.teacher_top_k: the teacher is loaded for its table, then freed; none while training."""
    reward_models: int = 0
    """The parameters of online RL's reward models (`rl.rewards` entries with a model: frozen, sharded as the
    policy)."""
    positions: int | None = None
    """The longest row the model (and its teacher, which reads the same rows) attends: the fewest positions their
    configs give, after config_overrides; None where neither says."""
    positions_of: str = "model.name_or_path"
    """The setting that names the model whose positions those are."""


def planned_model(recipe: RecipeConfig) -> PreTrainedModel:
    """The recipe's model on the meta device (a reward model's classifier for a reward_model section), with its
    adapters when the recipe has a peft section."""
    config = load_model_config(recipe.model)
    model = meta_model(as_reward_model(config) if recipe.reward_model is not None else config)
    if recipe.peft is not None:
        from finetune.model.adapters import add_adapters  # imports peft: only for adapter recipes

        model = add_adapters(model, recipe.peft)
    return model


def recipe_shape(recipe: RecipeConfig, model: PreTrainedModel | None = None) -> ModelShape:
    """The shape of the recipe's model (`model`, where the caller built it already), with its distillation teacher's
    size when it has one."""
    shape = model_shape(model if model is not None else planned_model(recipe))
    if recipe.rl is not None:
        scorers = [ModelConfig(name_or_path=reward.model) for reward in recipe.rl.rewards if reward.model is not None]
        counted = [model_shape(meta_model(load_model_config(cfg, "rl.rewards model"))).parameters for cfg in scorers]
        shape = replace(shape, reward_models=sum(counted))
    if recipe.distill is None:
        return shape
    if recipe.distill.teacher_config_file is None:
        check_model_path(recipe.distill.teacher, "distill.teacher")
    cfg = ModelConfig(name_or_path=recipe.distill.teacher, config_file=recipe.distill.teacher_config_file,
                      trust_remote_code=recipe.model.trust_remote_code)  # fmt: skip
    teacher = model_shape(meta_model(load_model_config(cfg, "distill.teacher", "distill.teacher_config_file")))
    table = recipe.distill.teacher_top_k is not None
    shape = replace(shape, teacher=teacher.parameters, teacher_hidden=teacher.hidden, teacher_table=table)
    if teacher.positions is not None and (shape.positions is None or teacher.positions < shape.positions):
        shape = replace(shape, positions=teacher.positions, positions_of="distill.teacher")
    return shape


def model_shape(model: PreTrainedModel) -> ModelShape:
    """Count parameters of a (meta-device) model and read the sizes activations depend on."""
    adapters = hasattr(model, "peft_config")
    model = model.get_base_model() if adapters else model
    text = model.config.get_text_config()
    unit_classes = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in unit_classes]
    largest = max((sum(p.numel() for p in m.parameters()) for m in units), default=0)
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    experts = experts_of(text)
    if experts is not None:
        intermediate = _active_mlp_width(units, experts, hidden, text.num_hidden_layers)
    return ModelShape(
        name=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        largest_unit=largest,
        layers=text.num_hidden_layers,
        hidden=hidden,
        intermediate=intermediate,
        kv_hidden=kv_heads * head_dim,
        vocab=text.vocab_size,
        heads=heads,
        head_dim=head_dim,
        routed=experts.active if experts is not None else 0,
        positions=positions_of(model.config),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        adapters=adapters,
        quantizable=sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and m is not model.get_output_embeddings()
        ),
    )


def _active_mlp_width(units: list[torch.nn.Module], experts: Experts, hidden: int, layers: int) -> int:
    """The gated MLP width a token of a mixture of experts goes through, per layer: the weights outside attention
    that it uses (top k of the routed experts, shared experts, dense MLP layers), over the 3 x hidden weights of
    each unit of gated width (gate, up, down). The routers' few weights count too: they round it up."""
    used = 0.0
    for unit in units:
        for name, parameter in unit.named_parameters():
            if parameter.ndim < 2 or "attn" in name:  # norms and biases; attention's projections
                continue
            used += parameter.numel() * (experts.active_fraction if is_routed_expert(name) else 1.0)
    return round(used / (3 * hidden * max(layers, 1)))


def micro_batch_line(recipe: RecipeConfig) -> str:
    if recipe.rl is not None:
        return f"{recipe.train.micro_batch_size} prompts ({sequences_per_forward(recipe)} completions)"
    if _kto(recipe):
        return f"{recipe.train.micro_batch_size} samples"
    if recipe.pairs_section is None:
        return str(recipe.train.micro_batch_size)
    return f"{recipe.train.micro_batch_size} pairs ({sequences_per_forward(recipe)} sequences)"


def _kto(recipe: RecipeConfig) -> bool:
    return recipe.preference is not None and recipe.preference.loss == "kto"


def sequences_per_forward(recipe: RecipeConfig) -> int:
    """Sequences in one forward with gradients: a micro-batch of pairs is twice its size (chosen and rejected), of
    prompts `num_generations` times it (their completions). The reference's pass (precomputed before training, or
    the adapters switched off) and KTO's mismatched sequences run without gradients: no activations kept."""
    if recipe.rl is not None:
        return recipe.train.micro_batch_size * recipe.rl.num_generations
    pairs = recipe.pairs_section is not None and not _kto(recipe)
    return recipe.train.micro_batch_size * (2 if pairs else 1)


def rollout_rows(recipe: RecipeConfig, launch: Launch) -> int:
    """The completions one device samples for a step: its prompts (micro-batches x accumulation) x generations
    (online RL), or one a row (on-policy distillation: a packed row's every sample is completed, so there it is
    the least)."""
    accumulation = recipe.train.accumulation(launch.data_parallel)
    generations = recipe.rl.num_generations if recipe.rl is not None else 1
    return recipe.train.micro_batch_size * accumulation * generations


def samples_on_policy(recipe: RecipeConfig) -> bool:
    """Whether the run samples completions on some steps as a distillation's on-policy steps."""
    return recipe.distill is not None and recipe.distill.on_policy_fraction > 0


def trainable_line(shape: ModelShape) -> str:
    adapters = f", {shape.trainable:,} of them trainable adapters (fp32)" if shape.adapters else ""
    if not shape.teacher:
        return adapters
    held = " for its top-k table, then freed" if shape.teacher_table else ", sharded as the model"
    return f"{adapters}; a frozen teacher of {shape.teacher:,} (distill){held}"
