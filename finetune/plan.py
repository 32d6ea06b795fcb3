"""`finetune plan`: will a recipe fit, per device, under each sharding strategy, before renting GPUs.

Everything comes from the model's config: the model is built on the meta device (no weights, no
memory) to count parameters exactly and to find the wrap units. Per device, with P parameters,
N processes sharding them, p the bytes of a stored parameter and c the bytes of the compute dtype:

    parameters        P*p / N                  (DDP: P*p)
    gradients         P*p / N                  (gradients live in the parameters' dtype)
    optimizer state   2*P*p / N                (AdamW's two moments)
    gather buffers    full shard: 2 units*c    (the unit computing and the one prefetched)
                      shard-grad-op: P*c       (kept unsharded from forward to backward)
    activations       see `activation_bytes`

With adapters (a recipe's `peft` section) gradients and optimizer state exist for the T trainable
adapter parameters only, in fp32: 4*T / N and 8*T / N; the parameters are the frozen base plus them.
QLoRA stores the base's linear weights (all but the output head) in 4 bits plus their double-quantized
block scales: 4.125 bits per weight (0.5 byte + 1 byte per 64 + 4 bytes per 64*256), and gathers them
packed. It also needs the whole 4-bit base on every device at load: transformers' bitsandbytes
loading places the quantized model on the process's GPU, and accelerate shards it only afterwards.

With CPU offload, parameters, gradients and optimizer state live in host RAM instead. The
parameter, gradient and optimizer figures are exactly what `finetune.memory` measures on the local
tensors (up to FSDP's padding of uneven shards); the activation estimate's error against a measured
CPU run is stated in docs/training.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from finetune.config import ModelConfig, RecipeConfig
from finetune.distributed import running_launch
from finetune.errors import FinetuneError
from finetune.family import Experts, experts_of, is_routed_expert
from finetune.launch import STRATEGIES, Launch, recipe_launch_problems
from finetune.model import (
    DTYPES,
    check_attention,
    check_mlp_tiling,
    check_model_path,
    check_packing,
    check_quantized_base,
    load_model_config,
    meta_model,
)
from finetune.recompute import Policy
from finetune.sequence import model_problems
from finetune.static_decode import cache_length
from finetune.teacher_table import CHUNK_ROWS as TABLE_CHUNK_ROWS
from finetune.wrap import wrap_classes

if TYPE_CHECKING:
    from accelerate import Accelerator

    from finetune.loss import LossPath

_MIXED = {"bf16": 2, "fp16": 2}
_NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # per weight: 4 bits, an 8-bit scale per block of 64, fp32 per 256 blocks


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


@dataclass(frozen=True)
class Estimate:
    """Bytes per device (GPU) and per host for one strategy."""

    strategy: str
    parameters: int
    gradients: int
    optimizer_state: int
    gather_buffers: int
    activations: int
    activations_checkpointed: int
    activations_selective: int
    host_at_load: int
    host_at_export: int
    device_at_load: int = 0
    """QLoRA only: the whole 4-bit base (and adapters) on each device before sharding; else 0."""
    host_offloaded: int = 0
    """train.activation_offload: the layer inputs every process of a machine keeps in its host memory."""
    device_at_table: int = 0
    """distill.teacher_top_k: the teacher's table computed before the first step, the teacher (sharded) beside the
    model's parameters, before any gradient or optimizer state; else 0."""
    generation: Generation | None = None
    """Online RL and on-policy distillation: the rollout phase, when gradients are freed and the KV cache and
    gathered parameters take their place."""

    def device_total(self, checkpointing: Policy) -> int:
        """Bytes while training under an activation-checkpointing policy."""
        activations = {
            "none": self.activations, "full": self.activations_checkpointed, "selective": self.activations_selective,
        }[checkpointing]  # fmt: skip
        return self.parameters + self.gradients + self.optimizer_state + self.gather_buffers + activations

    def device_peak(self, checkpointing: Policy) -> int:
        """The most a device holds: while training, while loading a QLoRA base, while generating (online RL), or
        while a distillation teacher's table is computed."""
        generating = self.generation.total(self) if self.generation is not None else 0
        return max(self.device_total(checkpointing), self.device_at_load, generating, self.device_at_table)


@dataclass(frozen=True)
class Generation:
    """Bytes per device of a rollout phase: online RL's (`finetune.objectives.grpo`) or on-policy distillation's."""

    kv_cache: int
    """Keys and values of every layer for a step's completions on the device, prompt and completion at full
    length."""
    whole: int
    """The whole model gathered, which the run keeps from the first decoding step to the last where it takes at
    most half the device's free memory."""
    per_layer: int
    """Else one layer gathered at a time (two in flight), at every decoding step: the least a rollout needs."""
    logits: int
    """One decoding step's fp32 logits and their softmax, for every row."""

    def total(self, training: Estimate) -> int:
        """The least a rollout holds (parameters gathered per layer): sharded parameters and optimizer state stay;
        gradients are freed (set to None after each step)."""
        return training.parameters + training.optimizer_state + self.per_layer + self.kv_cache + self.logits

    def gathers_once(self, training: Estimate, gpu_memory: int) -> bool:
        """What the run chooses (`finetune.objectives.grpo`): once where the whole model fits in half of what the
        sharded state leaves free."""
        return self.whole <= (gpu_memory - training.parameters - training.optimizer_state) / 2


def planned_model(recipe: RecipeConfig) -> PreTrainedModel:
    """The recipe's model on the meta device, with its adapters when the recipe has a peft section."""
    model = meta_model(load_model_config(recipe.model))
    if recipe.peft is not None:
        from finetune.adapters import add_adapters  # imports peft: only for adapter recipes

        model = add_adapters(model, recipe.peft)
    return model


def recipe_shape(recipe: RecipeConfig, model: PreTrainedModel | None = None) -> ModelShape:
    """The shape of the recipe's model (`model`, where the caller built it already), with its distillation teacher's
    size when it has one."""
    shape = model_shape(model if model is not None else planned_model(recipe))
    if recipe.distill is None:
        return shape
    if recipe.distill.teacher_config_file is None:
        check_model_path(recipe.distill.teacher, "distill.teacher")
    cfg = ModelConfig(name_or_path=recipe.distill.teacher, config_file=recipe.distill.teacher_config_file,
                      trust_remote_code=recipe.model.trust_remote_code)  # fmt: skip
    teacher = model_shape(meta_model(load_model_config(cfg)))
    table = recipe.distill.teacher_top_k is not None
    return replace(shape, teacher=teacher.parameters, teacher_hidden=teacher.hidden, teacher_table=table)


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


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    compute_bytes: int,
    checkpointing: Policy,
    loss: LossPath = "chunked",
    scores: int = 0,
    tile: int | None = None,
) -> int:
    """Bytes saved for backward in one micro-batch of `tokens` tokens (batch x sequence).

    Per token and layer a decoder layer keeps (in the compute dtype) its input, the two norm
    outputs, q/k/v and their rotary versions, the attention output, and the MLP's gate, up,
    activation and product: about 7h + 3kv + 4i values, plus the norms' fp32 copies of their input
    (h * 4 bytes each) under low-precision compute. Attention is SDPA/flash: no (sequence x sequence) matrix.
    The head, with `full_logits`, keeps the logits and the fp32 log-softmax of the loss: V*(c + 4)
    per token; `chunked` keeps the gradient of each token's hidden state (c*h) and, when the head
    trains, its weight's gradient (c*V*h, once) — every token counted as a target, the worst case.
    With full activation checkpointing each layer keeps only its input, and one layer's activations
    exist again while it is recomputed in backward; with selective checkpointing it also keeps its
    matmul and attention outputs (q, k, v, attention, o, gate, up, down: 4h + 2kv + 2i values).

    A mixture of experts' MLP width i is what a token goes through (its top k experts), and each of its k routed
    copies also keeps its input and its expert's output (2h values each) until they are weighted and summed.

    `tile` (`train.mlp_tile_tokens`): the MLP runs over tiles of that many tokens, each recomputed in backward, so
    its gate, up, activation and product (4i) exist for one tile of one layer at a time, and no layer keeps them
    (selective checkpointing keeps neither gate nor up then).

    `scores`: the attention scores a layer materializes, where its attention is `eager` (heads x n^2 per row
    of n tokens; sdpa and flash kernels keep none): each layer keeps the scores (c bytes) and their fp32 softmax
    (4 bytes); selective checkpointing keeps the scores (a matmul's output) and recomputes the softmax; full
    keeps neither, and has both once while a layer is recomputed.
    """
    mlp = compute_bytes * 4 * shape.intermediate  # per token: gate, up, activation, product
    tiled = min(tile, tokens) * mlp if tile else 0  # one tile's, once
    per_layer = compute_bytes * (7 * shape.hidden + 3 * shape.kv_hidden) + (0 if tile else mlp)
    per_layer += compute_bytes * 2 * shape.routed * shape.hidden
    matrices = scores * (compute_bytes + 4)
    if compute_bytes < 4:  # each of the two norms keeps its input in fp32 (measured: 8h bytes a token a layer)
        per_layer += 2 * shape.hidden * 4
    if loss == "full_logits":
        head = tokens * shape.vocab * (compute_bytes + 4)
    else:
        head = tokens * compute_bytes * shape.hidden + (
            0 if shape.adapters else compute_bytes * shape.vocab * shape.hidden
        )
    if checkpointing == "full":
        return tokens * (shape.layers * shape.hidden * compute_bytes + per_layer) + matrices + head + tiled
    if checkpointing == "selective":
        kept = compute_bytes * (5 * shape.hidden + 2 * shape.kv_hidden + (0 if tile else 2 * shape.intermediate))
        layers = shape.layers * scores * compute_bytes
        return tokens * (shape.layers * kept + per_layer) + layers + matrices + head + tiled
    return shape.layers * (tokens * per_layer + matrices) + head + tiled


def backward_bytes(shape: ModelShape, tokens: int, compute_bytes: int, tile: int | None = None) -> int:
    """What one layer's backward holds beyond what was saved for it (once: layers run their backward one at a
    time): the gradient that arrives and the one it builds for its input (h each per token), and its larger phase:
    the MLP's gradients of gate, up and their product (3i per token, of one tile when tiled), or attention's of
    q, k and v (h + 2kv per token). At 862K tokens on 8 GPUs (Qwen3-8B, untiled) this is about 8 GB a GPU: what a
    plan without it found to fit did not."""
    mlp_tokens = min(tile, tokens) if tile else tokens
    phase = max(mlp_tokens * 3 * shape.intermediate, tokens * (shape.hidden + 2 * shape.kv_hidden))
    return compute_bytes * (2 * tokens * shape.hidden + phase)


def estimate(shape: ModelShape, recipe: RecipeConfig, launch: Launch, strategy: str) -> Estimate:
    """Per-device bytes of `strategy` for this recipe on this launch."""
    param_bytes = DTYPES[recipe.model.dtype].itemsize
    compute_bytes = _MIXED.get(launch.mixed_precision, param_bytes)
    world = launch.num_processes
    shards = {"ddp": 1, "hybrid_shard": launch.processes_per_machine}.get(strategy, world)
    nf4 = recipe.peft is not None and recipe.peft.quantization == "nf4"
    trainable_bytes = shape.trainable * (4 if shape.adapters else param_bytes)  # adapters train in fp32
    frozen_bytes = (shape.parameters - shape.trainable) * param_bytes
    if nf4:
        frozen_bytes -= shape.quantizable * param_bytes - int(shape.quantizable * _NF4_BYTES)
    device_load = frozen_bytes + trainable_bytes if nf4 else 0
    parameters = (frozen_bytes + trainable_bytes) // shards
    # A frozen model (`reference.frozen_model`) sharded by FSDP2 is loaded in the compute precision.
    frozen_param = compute_bytes if strategy != "ddp" and launch.fsdp_version == 2 else param_bytes
    if recipe.preference is not None and recipe.preference.reference == "model":
        parameters += shape.parameters * frozen_param // shards  # the frozen reference, sharded as the policy
    if recipe.rl is not None and recipe.rl.beta and recipe.peft is None:
        parameters += shape.parameters * frozen_param // shards  # the initial weights, the KL penalty's reference
    # A distillation teacher: beside the model while training, or only while its table is computed.
    table = shape.teacher_table
    teacher = shape.teacher * frozen_param // shards
    parameters += 0 if table else teacher
    gradients, optimizer = trainable_bytes // shards, 2 * trainable_bytes // shards
    # What an all-gather moves per parameter: QLoRA gathers the packed 4-bit weights as they are stored.
    gathered_bytes = _NF4_BYTES if nf4 else compute_bytes
    if strategy in ("full_shard", "hybrid_shard"):
        gather = int(2 * shape.largest_unit * gathered_bytes)
    elif strategy == "shard_grad_op":
        gather = int(shape.parameters * gathered_bytes)
    else:  # DDP keeps full parameters; low-precision compute adds cast copies
        gather = shape.parameters * compute_bytes if compute_bytes != param_bytes else 0
    # Under sequence parallelism a device holds a slice of every row (`finetune.sequence`).
    tokens = math.ceil(_sequences(recipe) * recipe.data.max_length / launch.sequence_parallel)
    # Eager attention materializes each row's n x n scores per head (a packed row's too: its mask is dense).
    scores = tokens * recipe.data.max_length * shape.heads if recipe.model.attn_implementation == "eager" else 0
    tile = recipe.train.mlp_tile_tokens
    transient = backward_bytes(shape, tokens, compute_bytes, tile) + exchange_bytes(
        shape, tokens, compute_bytes, launch.sequence_parallel
    )
    # A teacher's output weight, copied out of its forward, and its last hidden states, while the model trains.
    transient += 0 if table else (shape.vocab + tokens) * shape.teacher_hidden * compute_bytes
    activations, checkpointed, selective = (
        activation_bytes(shape, tokens, compute_bytes, policy, loss=recipe.train.loss_path, scores=scores, tile=tile)
        + transient
        for policy in ("none", "full", "selective")
    )
    processes_per_host = launch.processes_per_machine
    offloaded = 0
    if recipe.train.activation_offload:
        # The layers' inputs wait in host memory; one layer's comes back at a time for its backward.
        offloaded = tokens * shape.hidden * compute_bytes * max(shape.layers - 1, 0)
        checkpointed, selective = checkpointed - offloaded, selective - offloaded
    full_model = shape.parameters * param_bytes
    # Loading: every process reads the full model, unless rank 0 alone does (cpu_ram_efficient_loading).
    host_load = full_model if launch.cpu_ram_efficient_loading else full_model * processes_per_host
    if nf4:  # each process streams the weight files (about 5 GB each) onto its device, quantizing them
        host_load = min(full_model, 5 * 10**9) * processes_per_host
    host_load += shape.teacher * frozen_param * processes_per_host  # every process loads the teacher whole
    if launch.offload and strategy != "ddp":
        host_load += (parameters + gradients + optimizer) * processes_per_host
        parameters = gradients = optimizer = 0
    # `finetune export` holds about one 5 GB output shard plus a tenth of it being converted.
    host_export = min(full_model, 5 * 10**9) * 12 // 10
    device_table = 0
    if table:  # the teacher's units gathered (scaled from the model's by size), its logits a chunk of rows at a time
        teacher_gather = gather * shape.teacher // max(shape.parameters, 1)
        device_table = parameters + teacher + teacher_gather + 2 * TABLE_CHUNK_ROWS * shape.vocab * 4
    training = Estimate(
        strategy, parameters, gradients, optimizer, gather, activations, checkpointed, selective, host_load,
        host_export, device_load, offloaded * processes_per_host, device_at_table=device_table,
    )  # fmt: skip
    if recipe.rl is None and not _on_policy(recipe):
        return training
    whole = shape.parameters * compute_bytes if strategy != "ddp" else gather  # unsharded: nothing to gather
    return replace(training, generation=generation_bytes(shape, recipe, launch, compute_bytes, whole, gather))


def generation_bytes(
    shape: ModelShape, recipe: RecipeConfig, launch: Launch, compute_bytes: int, whole: int, per_layer: int
) -> Generation:
    """A rollout on one device: a step's completions (`_rollout_rows`) decoded together, with a KV cache of
    `data.max_length` tokens each; a static one (`rl.rollout_cache`) is that rounded up to its allocation step,
    beside the prompts' dynamic cache it is filled from."""
    rows = _rollout_rows(recipe, launch)
    tokens = recipe.data.max_length
    if recipe.rl is not None and recipe.rl.rollout_cache == "static":
        tokens = cache_length(tokens) + tokens - recipe.rl.max_new_tokens
    kv_cache = rows * tokens * shape.layers * 2 * shape.kv_hidden * compute_bytes
    return Generation(kv_cache, whole, per_layer, rows * shape.vocab * 4 * 2)


def exchange_bytes(shape: ModelShape, tokens: int, compute_bytes: int, sequence_parallel: int) -> int:
    """The all-to-all buffers of one layer's attention under sequence parallelism (0 without): sent and received
    copies of its queries, keys and values (every query head's own key and value heads when the group is larger
    than their count), and of its output, `tokens` per device."""
    if sequence_parallel == 1:
        return 0
    kv_heads = shape.kv_hidden // max(shape.head_dim, 1)
    kv = shape.kv_hidden if kv_heads % sequence_parallel == 0 else shape.heads * shape.head_dim
    return 2 * tokens * compute_bytes * (2 * shape.heads * shape.head_dim + 2 * kv)


def _micro_batch(recipe: RecipeConfig) -> str:
    if recipe.rl is not None:
        return f"{recipe.train.micro_batch_size} prompts ({_sequences(recipe)} completions)"
    if recipe.preference is None:
        return str(recipe.train.micro_batch_size)
    return f"{recipe.train.micro_batch_size} pairs ({_sequences(recipe)} sequences)"


def _sequences(recipe: RecipeConfig) -> int:
    """Sequences in one forward: a micro-batch of pairs is twice its size (chosen and rejected), of prompts
    `num_generations` times it (their completions). The reference's pass (precomputed before training, or the
    adapters switched off) runs without gradients: no activations kept."""
    if recipe.rl is not None:
        return recipe.train.micro_batch_size * recipe.rl.num_generations
    return recipe.train.micro_batch_size * (2 if recipe.preference is not None else 1)


def _rollout_rows(recipe: RecipeConfig, launch: Launch) -> int:
    """The completions one device samples for a step: its prompts (micro-batches x accumulation) x generations
    (online RL), or one a row (on-policy distillation: a packed row's every sample is completed, so there it is
    the least)."""
    accumulation = recipe.train.accumulation(launch.data_parallel)
    generations = recipe.rl.num_generations if recipe.rl is not None else 1
    return recipe.train.micro_batch_size * accumulation * generations


def _on_policy(recipe: RecipeConfig) -> bool:
    """Whether the run samples completions on some steps as a distillation's on-policy steps."""
    return recipe.distill is not None and recipe.distill.on_policy_fraction > 0


def _trainable(shape: ModelShape) -> str:
    adapters = f", {shape.trainable:,} of them trainable adapters (fp32)" if shape.adapters else ""
    if not shape.teacher:
        return adapters
    held = " for its top-k table, then freed" if shape.teacher_table else ", sharded as the model"
    return f"{adapters}; a frozen teacher of {shape.teacher:,} (distill){held}"


def parse_memory(text: str) -> int:
    """'80GB' / '80GiB' / '24 GB' -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])(i?)B\s*", text, re.IGNORECASE)
    if match is None:
        raise FinetuneError(f"--gpu-memory {text!r} is not a size; write it like 80GB or 24GiB")
    power = "KMGT".index(match.group(2).upper()) + 1
    base = 1024 if match.group(3) else 1000
    size = int(float(match.group(1)) * base**power)
    if size <= 0:
        raise FinetuneError(f"--gpu-memory {text!r} is no memory; give the memory of one device, like 80GB")
    return size


def refuse_launch(recipe: RecipeConfig, launch: Launch) -> None:
    """What keeps this recipe from training on this launch at all (an rl run split over sequence groups, FSDP1
    where only FSDP2 serves), refused as training would refuse it: no plan for a launch that cannot run."""
    problems = recipe_launch_problems(
        recipe, fsdp_version=launch.fsdp_version if launch.strategy != "ddp" else 0,
        rank_zero_loading=launch.cpu_ram_efficient_loading, state_dict_type=launch.state_dict_type,
        sequence_parallel=launch.sequence_parallel, data_parallel=launch.data_parallel,
    )  # fmt: skip
    if problems:
        raise FinetuneError(f"cannot train with {launch.config_path}: " + "; ".join(problems))


def plan(recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """The report: a table per strategy and a verdict for the configured one."""
    refuse_launch(recipe, launch)
    shape = recipe_shape(recipe)
    estimates = {strategy: estimate(shape, recipe, launch, strategy) for strategy in STRATEGIES}
    largest = max(e.device_total("none") for e in estimates.values())
    unit_name, gib = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    lines = [
        f"{shape.name}: {shape.parameters:,} parameters ({recipe.model.dtype}){_trainable(shape)}, largest wrap unit "
        f"{shape.largest_unit:,}; micro-batch {_micro_batch(recipe)} x {recipe.data.max_length} tokens; "
        f"{launch.num_processes} processes on {launch.num_machines} machine(s); mixed precision "
        f"{launch.mixed_precision}",
        f"per device, {unit_name} (device memory {gpu_memory / gib:.1f}):",
        f"  {'strategy':<15} {'params':>8} {'grads':>8} {'optim':>8} {'gather':>8} {'activ.':>8} {'act.+AC':>8} "
        f"{'total':>8} {'total+AC':>9}",
    ]
    for strategy, e in estimates.items():
        marker = "*" if strategy == launch.strategy else " "
        lines.append(
            f"{marker} {strategy:<15} {e.parameters / gib:>8.2f} {e.gradients / gib:>8.2f} "
            f"{e.optimizer_state / gib:>8.2f} {e.gather_buffers / gib:>8.2f} {e.activations / gib:>8.2f} "
            f"{e.activations_checkpointed / gib:>8.2f} {e.device_total('none') / gib:>8.2f} "
            f"{e.device_total('full') / gib:>9.2f}"
        )
    chosen = estimates[launch.strategy]
    policy = run_policy(chosen, recipe, launch, gpu_memory)
    if recipe.train.recompute == "auto" and not launch.activation_checkpointing:
        policy = f"auto, so {policy}"
    lines.append(
        f"activation checkpointing (this run: {policy}), activations per device: none "
        f"{chosen.activations / gib:.2f}, selective {chosen.activations_selective / gib:.2f}, full "
        f"{chosen.activations_checkpointed / gib:.2f} {unit_name}"
    )
    lines.append(
        f"host RAM per machine: {chosen.host_at_load / gib:.1f} {unit_name} at load"
        f"{' (rank 0 loads, cpu_ram_efficient_loading)' if launch.cpu_ram_efficient_loading else ''}, "
        f"{chosen.host_at_export / gib:.1f} {unit_name} at export"
        + (
            f", {chosen.host_offloaded / gib:.1f} {unit_name} of offloaded layer inputs (train.activation_offload)"
            if chosen.host_offloaded
            else ""
        )
    )
    if chosen.generation is not None:
        rollout = chosen.generation
        once = rollout.gathers_once(chosen, gpu_memory)
        gathered = (
            "parameters whole on the device (no sharding)"
            if launch.strategy == "ddp"
            else f"the whole model gathered once per rollout, {rollout.whole / gib:.2f}"
            if once
            else f"parameters gathered per layer at every token, {rollout.per_layer / gib:.2f}"
        )
        peak = rollout.total(chosen) - rollout.per_layer + (rollout.whole if once else rollout.per_layer)
        rows = _rollout_rows(recipe, launch)
        kind = "rl" if recipe.rl is not None else "on-policy distill"
        kind += ", a static cache" if recipe.rl is not None and recipe.rl.rollout_cache == "static" else ""
        each = " (one a row; a packed row's other samples add theirs)" if recipe.data.packing and kind != "rl" else ""
        lines.append(
            f"generation ({kind}: {rows} completions a step{each}): KV cache {rollout.kv_cache / gib:.2f}, "
            f"{gathered}, logits {rollout.logits / gib:.2f}; {peak / gib:.2f} {unit_name} per device while generating"
        )
    if chosen.device_at_load:
        lines.append(
            f"device memory at load: {chosen.device_at_load / gib:.1f} {unit_name} (the whole 4-bit base on every "
            "device until it is sharded)"
        )
    lines.append(f"verdict (* = this config): {verdict(shape, recipe, launch, gpu_memory)}")
    longest = longest_fitting_length(shape, recipe, launch, gpu_memory)
    lines.append(
        f"longest data.max_length this launch fits: {longest:,} tokens ({_long_row_pieces(shape, recipe, launch)})"
        if longest
        else "longest data.max_length this launch fits: none of 1,024 tokens or more"
    )
    return "\n".join(lines)


def _long_row_pieces(shape: ModelShape, recipe: RecipeConfig, launch: Launch) -> str:
    """Which of the pieces that lengthen a row this launch uses, and which it does not (ALST's set: sequence
    parallelism, tiled MLP and loss, activation checkpointing with its inputs offloaded, state offloaded)."""
    pieces = {
        f"sequence parallel over {launch.sequence_parallel}": launch.sequence_parallel > 1,
        f"MLP tiles of {recipe.train.mlp_tile_tokens or 0:,} tokens": bool(recipe.train.mlp_tile_tokens),
        "chunked loss": recipe.train.loss_path == "chunked",
        "activation checkpointing": launch.activation_checkpointing or recipe.train.recompute != "none",
        "layer inputs offloaded": recipe.train.activation_offload,
        "parameters and optimizer state offloaded": launch.offload,
    }
    used = [piece for piece, on in pieces.items() if on]
    unused = {
        "train.mlp_tile_tokens": not recipe.train.mlp_tile_tokens and not shape.routed,  # tiles: dense MLPs only
        "train.activation_offload": not recipe.train.activation_offload,
        "an offload config": not launch.offload,
        "parallelism_config_sp_size": launch.sequence_parallel == 1 and launch.num_processes > 1,
    }
    without = [name for name, missing in unused.items() if missing]
    return f"with {', '.join(used) or 'none of the pieces'}" + (f"; not with {', '.join(without)}" if without else "")


def longest_fitting_length(shape: ModelShape, recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> int:
    """The longest `data.max_length`, in steps of 1,024 tokens, whose estimate fits `gpu_memory` under the run's
    checkpointing policy (`auto`: the cheapest that fits), everything else as the recipe says; 0 if none does."""

    def fits(length: int) -> bool:
        resized = replace(recipe, data=replace(recipe.data, max_length=length))
        chosen = estimate(shape, resized, launch, launch.strategy)
        return chosen.device_peak(run_policy(chosen, resized, launch, gpu_memory)) <= usable_memory(gpu_memory)

    low, high = 0, 2**12  # in units of 1,024 tokens: up to 4,194,304
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * 1024) else (low, middle - 1)
    return low * 1024


def verdict(shape: ModelShape, recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """fits / fits with checkpointing or offload / does not fit, for the configured strategy."""
    chosen = estimate(shape, recipe, launch, launch.strategy)
    checkpointing = run_policy(chosen, recipe, launch, gpu_memory)
    usable = usable_memory(gpu_memory)
    kept = f"{(gpu_memory - usable) / 2**30:.1f} of the device's {gpu_memory / 2**30:.1f} kept as headroom"
    if chosen.device_at_load > usable:
        return (
            f"does not fit at load ({chosen.device_at_load / 2**30:.1f} GiB needed of {usable / 2**30:.1f}; {kept}): "
            "transformers loads the whole 4-bit base onto every device before accelerate shards it; use devices "
            f"with at least {math.ceil(chosen.device_at_load / 2**30 * 1.1)} GiB"
        )
    need = chosen.device_peak(checkpointing)
    if need <= usable:
        at_load = " at load" if chosen.device_at_load > chosen.device_total(checkpointing) else ""
        return f"fits ({need / 2**30:.1f} of {usable / 2**30:.1f} GiB{at_load}; {kept})"
    if checkpointing == "none" and chosen.device_total("selective") <= usable:
        return "fits with selective activation checkpointing (train.activation_checkpointing: selective)"
    if checkpointing != "full" and chosen.device_total("full") <= usable:
        return "fits with activation checkpointing (train.activation_checkpointing: full)"
    if launch.strategy != "ddp" and not launch.offload:
        offloaded = estimate(
            shape, recipe, replace(launch, offload=True, activation_checkpointing=True), launch.strategy
        )
        if offloaded.device_total("full") <= usable:
            return "fits with CPU offload and activation checkpointing (accelerate_configs/fsdp2_offload.yaml)"
    more = math.ceil(need / usable * launch.num_processes)
    return (
        f"does not fit ({need / 2**30:.1f} GiB needed of {usable / 2**30:.1f}; {kept}); "
        f"shard over more devices (about {more}), lower micro_batch_size or max_length"
    )


def run_policy(chosen: Estimate, recipe: RecipeConfig, launch: Launch, gpu_memory: int | None) -> Policy:
    """The activation-checkpointing policy the run uses: the accelerate config's (full) or the recipe's,
    `auto` resolved by `cheapest_policy` on the launch's estimate `chosen`."""
    if launch.activation_checkpointing:
        return "full"
    if recipe.train.recompute != "auto":
        return recipe.train.recompute
    return cheapest_policy(chosen, gpu_memory)


def cheapest_policy(chosen: Estimate, gpu_memory: int | None) -> Policy:
    """`train.activation_checkpointing: auto`: the first of none, selective, full (least recomputation first)
    whose estimated peak (`chosen`, the launch's strategy) fits `gpu_memory` less its headroom; full when none does
    (the verdict then says what else to change); none when there is no device memory to fit (CPU)."""
    if gpu_memory is None:
        return "none"
    policies: tuple[Policy, ...] = ("none", "selective", "full")
    usable = usable_memory(gpu_memory)
    return next((policy for policy in policies if chosen.device_peak(policy) <= usable), "full")


def usable_memory(gpu_memory: int) -> int:
    """What a plan may fill of a device's memory: all but a headroom for what no estimate counts, 5% for the
    caching allocator's fragmentation and 1 GiB for the CUDA context, its kernels and NCCL's buffers (5% more on
    devices under 20 GiB)."""
    return gpu_memory - gpu_memory // 20 - min(2**30, gpu_memory // 20)


_RECOMPUTED = {
    "none": "every activation kept, nothing recomputed",
    "full": "each decoder layer keeps its input and recomputes its forward in backward",
    "selective": "decoder layers keep matmul and attention outputs and recompute the rest",
}


def recompute_policy(recipe: RecipeConfig, accelerator: Accelerator) -> tuple[Policy, str | None]:
    """The recipe's activation-checkpointing policy, `auto` resolved by the plan's estimate against this
    device's memory (`cheapest_policy`), and its log line (None for none, asked for)."""
    requested = recipe.train.recompute
    if requested != "auto":
        line = f"activation checkpointing: {requested} ({_RECOMPUTED[requested]})" if requested != "none" else None
        if recipe.train.activation_offload:
            line = f"{line}; layer inputs kept in host memory until their backward (train.activation_offload)"
        return requested, line
    cuda = accelerator.device.type == "cuda"
    memory = torch.cuda.get_device_properties(accelerator.device).total_memory if cuda else None
    launch = running_launch(accelerator)
    policy = cheapest_policy(estimate(recipe_shape(recipe), recipe, launch, launch.strategy), memory)
    reason = (
        f"the first that the plan fits in {memory / 2**30:.1f} GiB"
        if memory
        else f"{accelerator.device.type}: no device memory to fit"
    )
    return policy, f"activation checkpointing: auto, so {policy} ({reason}; {_RECOMPUTED[policy]})"


def check(recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """`finetune check`: everything about a launch that can be known before starting it, offline.

    The recipe and launch sizes were validated when they were read; here the model is built on the
    meta device from its config, its wrap classes are found in it, and the memory plan is given.
    Problems raise FinetuneError; a plan that does not fit is reported, not refused (it is an estimate).
    """
    refuse_launch(recipe, launch)
    check_attention(recipe.model)
    check_mlp_tiling(recipe.model, recipe.train.mlp_tile_tokens)
    check_packing(recipe.model, recipe.data.packing)
    check_quantized_base(recipe.model, adapters=recipe.peft is not None, export_merged=recipe.output.export_merged)
    model = planned_model(recipe)
    problems = model_problems(model.config, launch.sequence_parallel)
    if problems:
        raise FinetuneError(f"cannot train with {launch.config_path}: " + "; ".join(problems))
    shape = recipe_shape(recipe, model)
    source = recipe.model.config_file or recipe.model.name_or_path
    lines = [f"model: {shape.name} from {source}, {shape.parameters:,} parameters{_trainable(shape)}"]
    if launch.strategy != "ddp" and launch.wrap_policy == "TRANSFORMER_BASED_WRAP":
        classes = wrap_classes(launch.wrap_classes, model)
        units = sum(type(m).__name__ in classes for m in model.modules())
        lines.append(f"wrap: {units} units of {', '.join(classes)}")
    lines.append(f"launch: {launch.describe()}")
    lines.append(f"memory per device: {verdict(shape, recipe, launch, gpu_memory)}")
    lines.append(_template_line(recipe))
    return "\n".join(lines)


def _template_line(recipe: RecipeConfig) -> str:
    """The recipe's chat template tried on probe conversations, where its tokenizer is on this machine."""
    from finetune.data.chat import probe_template
    from finetune.model import load_tokenizer, model_folder

    if model_folder(recipe.model.name_or_path) is None:
        return "chat template: not checked (the tokenizer of model.name_or_path is not on this machine yet)"
    return probe_template(load_tokenizer(recipe.model, recipe.data.chat_template))
