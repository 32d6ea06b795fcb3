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
parameter, gradient and optimizer figures are exactly what `finetune.engine.memory` measures on the local
tensors (up to FSDP's padding of uneven shards); the activation estimate's error against a measured
CPU run is stated in docs/training.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from finetune.config import RecipeConfig
from finetune.engine.launch import Launch
from finetune.engine.recompute import Policy
from finetune.model.loading import (
    DTYPES,
)
from finetune.objectives.teacher_table import CHUNK_ROWS as TABLE_CHUNK_ROWS
from finetune.plan.shape import ModelShape, rollout_rows, samples_on_policy, sequences_per_forward
from finetune.rollouts.static_decode import cache_length

if TYPE_CHECKING:
    from finetune.objectives.loss import LossPath


_MIXED = {"bf16": 2, "fp16": 2}


_NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # per weight: 4 bits, an 8-bit scale per block of 64, fp32 per 256 blocks


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
    parameters += shape.reward_models * frozen_param // shards  # online RL's reward models, sharded as the policy
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
    # Under sequence parallelism a device holds a slice of every row (`finetune.engine.sequence`).
    tokens = math.ceil(sequences_per_forward(recipe) * recipe.data.max_length / launch.sequence_parallel)
    # Eager attention materializes each row's n x n scores per head (a packed row's too: its mask is dense).
    scores = tokens * recipe.data.max_length * shape.heads if recipe.model.attn_implementation == "eager" else 0
    tile = recipe.train.mlp_tile_tokens
    transient = backward_bytes(shape, tokens, compute_bytes, tile) + exchange_bytes(
        shape, tokens, compute_bytes, launch.sequence_parallel
    )
    # A teacher's output weight, copied out of its forward, and its last hidden states, while the model trains; the
    # sampled estimator keeps neither: the teacher gives each trained token's log-probability from inside its forward.
    sampled = recipe.distill is not None and recipe.distill.estimator == "sampled"
    transient += 0 if table or sampled else (shape.vocab + tokens) * shape.teacher_hidden * compute_bytes
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
    if recipe.rl is None and not samples_on_policy(recipe):
        return training
    whole = shape.parameters * compute_bytes if strategy != "ddp" else gather  # unsharded: nothing to gather
    return replace(training, generation=generation_bytes(shape, recipe, launch, compute_bytes, whole, gather))


def generation_bytes(
    shape: ModelShape, recipe: RecipeConfig, launch: Launch, compute_bytes: int, whole: int, per_layer: int
) -> Generation:
    """A rollout on one device: a step's completions (`rollout_rows`) decoded together, with a KV cache of
    `data.max_length` tokens each; a static one (`rl.rollout_cache`) is that rounded up to its allocation step,
    beside the prompts' dynamic cache it is filled from. Agents' episodes feed the tools' answers left-padded
    within a step, and their cache is rebuilt when that padding would pass half an episode's room
    (`finetune.rollouts.episodes`): one and a half times the tokens at most."""
    rows = rollout_rows(recipe, launch)
    tokens = recipe.data.max_length
    if recipe.rl is not None and recipe.rl.rollout_cache == "static":
        tokens = cache_length(tokens) + tokens - recipe.rl.max_new_tokens
    if recipe.rl is not None and recipe.rl.agents:
        tokens += tokens // 2
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
