"""Recipe YAML -> typed, validated config.

A recipe holds hyperparameters; hardware and sharding live in the accelerate config. Every field
below is documented where it is declared. Loading reports all problems at once: unknown keys
(with the nearest valid key), missing required fields, wrong types and contradictory values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from finetune.errors import FinetuneError


class ConfigError(FinetuneError):
    """One or more problems in a recipe or its command-line overrides."""


# accelerate's tracker names (accelerate.utils.LoggerType), listed so that a typo fails here, not at step 1.
# data.train[].fraction above this is refused: repeats are index lists over one copy of the data, but a
# mixture that large is a typo (1e9) or an epoch count in disguise (train.num_epochs says it better).
MAX_FRACTION = 1000

# A field's metadata key: the value a setting left empty (`null` in YAML, `key=` on the command line) stands for.
# Intervals whose 0 means never take null as never too; other empty settings are refused.
NEVER = "null means"

TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")


@dataclass(kw_only=True)
class ModelConfig:
    name_or_path: str
    """Hub id or local folder of a causal LM and its tokenizer."""

    config_file: str | None = None
    """The model's config.json, shipped with the recipe (recipes/<family>/configs/): `finetune plan` and
    `finetune check` build the model from it on the meta device, offline. Training loads `name_or_path`."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the stored (master) parameters and optimizer state. Keep float32 and set
    `mixed_precision: bf16` in the accelerate config for bf16 compute; bfloat16 here trains in pure bf16."""

    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers: sdpa, eager, flash_attention_2, or `varlen`: packed rows
    attend by their sample boundaries, through torch's FlashAttention varlen kernel on GPUs (bf16/fp16) and
    per-sample SDPA elsewhere, instead of through a dense block mask (finetune/engine/attention.py)."""

    experts_implementation: Literal["grouped_mm", "batched_mm", "eager"] = "grouped_mm"
    """Mixtures of experts: how a layer's experts compute (transformers' experts implementations):
    `grouped_mm` one grouped matmul over all experts (the fastest; every expert dimension must span a
    multiple of 16 bytes), `batched_mm` each token's experts as one batched matmul, `eager` a loop over
    the experts. Dense models have none to choose."""

    kernels: Literal["liger"] | None = None
    """`liger`: RMSNorm, SwiGLU and rotary embeddings in liger-kernel's fused Triton kernels (the `gpu` extra;
    CUDA GPUs, dense models of the families liger-kernel knows: finetune/model/kernels.py). Unset: transformers' eager
    operators, which regional compilation fuses instead."""

    trust_remote_code: bool = False
    """Run modelling code shipped with the checkpoint. Off unless you trust its source."""

    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Settings of the model's config.json that this run changes, written with its checkpoints and exports, e.g.
    a longer context by RoPE scaling: {max_position_embeddings: 131072, rope_parameters: {rope_type: yarn,
    factor: 4.0, original_max_position_embeddings: 32768, rope_theta: 1000000}}. Each must be a setting the
    config has."""


@dataclass(kw_only=True)
class SourceConfig:
    """One dataset of a training mixture (`data.train`)."""

    path: str
    """Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of them."""

    split: str = "train"
    """Split of a hub dataset."""

    subset: str | None = None
    """Configuration (subset) of a hub dataset that has several, e.g. math of open-r1/Mixture-of-Thoughts."""

    columns: dict[str, str | None] = field(default_factory=dict)
    """The source's column for each column finetune reads, e.g. {messages: conversations}; null leaves that
    column out where the source has it, e.g. {tools: null} for data whose system text already lists its tools."""

    fraction: float = 1.0
    """How much of the source goes into the mixture: 0.25 takes a seeded quarter of its samples, 2
    takes every sample twice; must be > 0."""


@dataclass(kw_only=True)
class DataConfig:
    train_path: str | None = None
    """Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of them (one source;
    `train` for several)."""

    train_split: str = "train"
    """Split of `train_path` to train on."""

    train: list[SourceConfig] | None = None
    """A mixture of sources instead of `train_path`: each with its path, split, column mapping and
    fraction, mixed into one seeded order (the same on any process count, and on resume)."""

    eval_path: str | None = None
    """Hub id or local file for evaluation; None to carve `eval_fraction` out of the training data."""

    eval_split: str = "train"
    """Split of `eval_path` to evaluate on."""

    eval_fraction: float = 0.0
    """Fraction of the training data held out for evaluation when `eval_path` is None (0 = no eval)."""

    eval_samples: int | None = None
    """Evaluate on a seeded subset of this many samples of the eval data (the same on every resume and process
    count) instead of all of it; None evaluates everything."""

    invalid: Literal["refuse", "drop"] = "refuse"
    """A malformed sample (see the errors table): refuse stops the run naming it; drop leaves it out and counts it
    per source, with the first indices and reasons in the log. A source of which more than 1% is invalid stops
    the run either way: that is the wrong data or the wrong column mapping, not a few bad rows."""

    truncation: Literal["truncate", "drop"] = "truncate"
    """A sample longer than `max_length`: truncate it (counted), or drop it (counted per source): a reasoning
    trace cut short teaches the model to think without concluding."""

    format: Literal["auto", "chat", "prompt_completion", "text", "preference"] = "auto"
    """Sample layout: chat (`messages`), prompt_completion (`prompt`, `completion`), text (`text`),
    preference (`chosen`, `rejected`, and `prompt` unless they are whole conversations: needs a `preference`
    section), or auto to pick by the columns present."""

    max_length: int
    """Maximum tokens per sample; longer samples are truncated and counted. Also the packed row length."""

    packing: bool = True
    """Concatenate samples into rows of `max_length` tokens (attention and positions do not cross
    samples); False pads each batch to its longest sample."""

    packing_window: int | None = None
    """Samples packed together: each window of the shuffled data is packed best-fit decreasing on its own
    (the same rows on any process count). Unset: 2,000, which fills rows to about 98% on chat-like lengths;
    larger windows fill a little fuller for more CPU time. At most the training data's sample count."""

    completion_only_loss: bool = True
    """Train on assistant/completion tokens only; False trains on prompts too. Ignored for text."""

    chat_template: str | None = None
    """Chat data: a Jinja chat template (a .jinja file, or the template itself) used instead of the
    tokenizer's, e.g. for a base model that has none. It is saved with checkpoints and exports, so
    inference formats prompts the way training did."""

    train_on_reasoning: bool = True
    """Take loss on the reasoning of replies (a `reasoning_content` field, or a leading <think> block, in
    conversations and text completions or pairs); False keeps it in the text as context only. The log counts
    reasoning tokens. Not for online RL, which trains what it samples."""

    multi_turn: Literal["full", "per_turn", "last"] = "full"
    """Chat data: train every assistant reply of a conversation in one sample (full), only its last
    reply (last), or, for conversations whose chat template makes replies impossible to locate in one
    rendering, one sample per reply with its prompt as rendered for generation (per_turn, counted in the log)."""

    def sources(self) -> list[SourceConfig]:
        """The training sources: `train`, or `train_path` as a mixture of one."""
        return self.train if self.train is not None else [SourceConfig(path=self.train_path, split=self.train_split)]

    def errors(self) -> list[str]:
        errors = []
        if (self.train_path is None) == (self.train is None):
            errors.append("set data.train_path (one source) or data.train (a list of sources), not both")
        for i, source in enumerate(self.train or []):
            if source.fraction <= 0:
                errors.append(f"data.train[{i}].fraction must be > 0, got {source.fraction}")
            elif source.fraction > MAX_FRACTION:
                errors.append(
                    f"data.train[{i}].fraction={source.fraction:g} repeats the source more than {MAX_FRACTION} times; "
                    "use train.num_epochs for more passes over the data"
                )
        if self.train is not None and not self.train:
            errors.append("data.train is an empty list; give at least one source")
        if self.max_length < 8:
            errors.append(f"data.max_length must be >= 8 tokens, got {self.max_length}")
        if not 0.0 <= self.eval_fraction < 1.0:
            errors.append(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_path is not None and self.eval_fraction > 0:
            errors.append("set data.eval_path or data.eval_fraction, not both")
        if self.eval_samples is not None and self.eval_samples < 1:
            errors.append(
                f"data.eval_samples must be >= 1 (or left out to evaluate everything), got {self.eval_samples}"
            )
        if self.eval_samples is not None and self.eval_path is None and self.eval_fraction == 0:
            errors.append("data.eval_samples takes a subset of the eval data, but there is none: set data.eval_path")
        if self.packing_window is not None and self.packing_window < 1:
            errors.append(f"data.packing_window must be >= 1 sample, got {self.packing_window}")
        if self.packing_window is not None and not self.packing:
            errors.append("data.packing_window sets how samples are packed, but data.packing is false; drop one")
        if not self.completion_only_loss and not self.train_on_reasoning:
            errors.append(
                "data.train_on_reasoning=false keeps reasoning out of the loss, but data.completion_only_loss=false "
                "trains every token, reasoning included; drop one of the two"
            )
        return errors


@dataclass(kw_only=True)
class OptimConfig:
    lr: float
    """Peak learning rate of AdamW."""

    weight_decay: float = 0.0
    """Decoupled weight decay of AdamW."""

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8

    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, down to `min_lr_ratio` x `lr` at the last step."""

    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""

    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr`."""

    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""

    def errors(self) -> list[str]:
        errors = []
        if self.lr <= 0:
            errors.append(f"optim.lr must be > 0, got {self.lr}")
        if self.max_grad_norm < 0:
            errors.append(f"optim.max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            errors.append(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                errors.append(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps < 0:
            errors.append(f"optim.adam_eps must be >= 0, got {self.adam_eps}")
        if self.weight_decay < 0:
            errors.append(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        return errors


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 42
    """Seed for model init, data order and dropout."""

    micro_batch_size: int
    """Samples per process per forward pass: sequences, pairs (preference) or prompts (rl)."""

    global_batch_size: int | None = None
    """Samples per optimizer step over every data-parallel process: sequences, pairs (preference) or prompts (rl,
    each answered num_generations times). Set, a step means the same on any launch: gradient accumulation follows,
    global_batch_size / (micro_batch_size x data-parallel processes), which must be a whole number."""

    gradient_accumulation_steps: int | None = None
    """Micro-batches per process per optimizer step, when global_batch_size is unset (default 1): the global batch
    is then micro_batch_size x this x data-parallel processes, and changes with the launch."""

    max_steps: int | None = None
    """Optimizer steps to run. Set this or `num_epochs`, not both."""

    num_epochs: float | None = None
    """Passes over the training data (fractions allowed). Set this or `max_steps`, not both."""

    eval_every_steps: int = field(default=0, metadata={NEVER: 0})
    """Evaluate every this many optimizer steps, and at the end (0 or null = only at the end)."""

    log_every_steps: int = 1
    """Write metrics every this many optimizer steps."""

    activation_checkpointing: Literal[False, True, "none", "full", "selective", "auto"] = False
    """What decoder layers keep for backward (`finetune.engine.recompute`): `none` (false) everything; `full`
    (true) only their input, recomputing the rest; `selective` matmul and attention outputs,
    recomputing the cheap rest; `auto`: the first of none, selective, full that `finetune plan`
    estimates to fit the GPU's memory (none on CPU, said in the log). Or set
    `fsdp_activation_checkpointing` (full) in the accelerate config instead (not both)."""

    activation_offload: bool = False
    """Keep what activation checkpointing keeps of each decoder layer (its input) in host memory, pinned, and bring
    it back for the layer's backward (`finetune.engine.recompute.offload_layer_inputs`): the activations left on the
    GPU no longer grow with the layer count. Needs `activation_checkpointing` full or selective."""

    mlp_tile_tokens: int | None = None
    """Compute each decoder layer's MLP over tiles of this many tokens of the sequence, each recomputed in its
    backward (`finetune.engine.recompute.tile_mlps`, ALST's tiled MLP): the MLP's activations, the largest a layer
    makes (4 x its intermediate width per token), exist for one tile at a time. For rows of tens of thousands of tokens
    (`finetune plan` counts it); each MLP's forward runs once more. Unset: untiled. Not for mixtures of experts."""

    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: record these optimizer steps (inclusive) with the torch profiler, a trace and a table per
    process under `<output.dir>/profile/` (`finetune.run.profile`); [] records nothing."""

    loss_path: Literal["chunked", "full_logits"] = "chunked"
    """`chunked`: logits only at positions with a target, projected and scored a chunk of rows at a
    time, never the full fp32 logits (models whose output layer is not a plain projection fall back,
    said in the log); `full_logits`: the reference, every position's logits in fp32."""

    router_aux_loss_coef: float | None = None
    """Mixtures of experts: the weight of the routers' load-balancing loss added to the objective
    (`finetune.model.routing`); unset: the model config's own coefficient (none for a dense model or one that
    routes without it); 0 turns it off."""

    objective: str | None = None
    """An objective of your own, as `module:attribute`: a callable taking the recipe and returning a
    `finetune.objectives.ObjectiveBuilder`; unset: supervised fine-tuning, or preference tuning with a
    `preference` section."""

    def accumulation(self, data_parallel: int) -> int:
        """Micro-batches per process per optimizer step on a launch of `data_parallel` processes with rows of their
        own (`batch_problems` has refused a global batch they do not divide)."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps or 1
        return max(1, self.global_batch_size // (self.micro_batch_size * data_parallel))

    def batch_problems(self, data_parallel: int) -> list[str]:
        """Why train.global_batch_size cannot be split over `data_parallel` processes, with the fix; [] if it can."""
        per_step = self.micro_batch_size * data_parallel
        if self.global_batch_size is None or self.global_batch_size % per_step == 0:
            return []
        below = max(per_step, self.global_batch_size // per_step * per_step)
        return [
            f"train.global_batch_size={self.global_batch_size} is not a whole number of micro-batches of "
            f"{self.micro_batch_size} on {data_parallel} data-parallel process(es) ({per_step} samples a round); set "
            f"it to a multiple of {per_step} (e.g. {below} or {below + per_step}), or change train.micro_batch_size"
        ]

    @property
    def recompute(self) -> Literal["none", "full", "selective", "auto"]:
        """`activation_checkpointing` as a policy (or `auto`, which training resolves): true is full, false none."""
        value = self.activation_checkpointing
        return "full" if value is True else "none" if value is False else value

    def errors(self) -> list[str]:
        errors = []
        if (self.max_steps is None) == (self.num_epochs is None):
            errors.append("set exactly one of train.max_steps and train.num_epochs")
        if self.max_steps is not None and self.max_steps < 1:
            errors.append(f"train.max_steps must be >= 1, got {self.max_steps}")
        if self.num_epochs is not None and self.num_epochs <= 0:
            errors.append(f"train.num_epochs must be > 0, got {self.num_epochs}")
        if self.activation_offload and self.recompute not in ("full", "selective"):
            errors.append(
                f"train.activation_offload keeps the inputs that activation checkpointing saves, and "
                f"train.activation_checkpointing is {self.activation_checkpointing}; set it to full or selective"
            )
        counts = ("micro_batch_size", "global_batch_size", "gradient_accumulation_steps", "log_every_steps")
        for name in (*counts, "mlp_tile_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                errors.append(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.gradient_accumulation_steps is not None:
            errors.append(
                f"train.global_batch_size={self.global_batch_size} sets the accumulation for the launch, and "
                f"train.gradient_accumulation_steps={self.gradient_accumulation_steps} sets it too; unset one "
                "(global_batch_size keeps a step the same on any number of processes)"
            )
        if self.eval_every_steps < 0:
            errors.append(f"train.eval_every_steps must be >= 0, got {self.eval_every_steps}")
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            errors.append(f"train.router_aux_loss_coef must be >= 0 (0 turns it off), got {self.router_aux_loss_coef}")
        steps = self.profile_steps
        if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
            errors.append(f"train.profile_steps must be [first, last] with 1 <= first <= last, got {steps}")
        return errors


@dataclass(kw_only=True)
class OutputConfig:
    dir: str
    """Folder for the resolved recipe, metrics, per-rank reports and the exported model."""

    overwrite: bool = False
    """Allow writing into a non-empty `dir`. Without it a run refuses, so earlier results are never lost."""

    trackers: list[str] = field(default_factory=list)
    """Accelerate trackers to log to, e.g. [tensorboard] (one of TRACKERS). Metrics always go to `metrics.jsonl`."""

    export: bool = True
    """At the end of training, save a checkpoint of the last step and export it (the same exporter as
    `finetune export`, on one process after the others finished) to `<dir>/final`."""

    export_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of exported weights; None keeps the training dtype of the parameters (`model.dtype`)."""

    export_merged: bool = False
    """Adapter runs: also export the base model with the adapter folded in, to `<dir>/final_merged`
    (`finetune export --merge`). `<dir>/final` always holds the adapter itself."""

    def errors(self) -> list[str]:
        errors = []
        if not self.dir.strip():
            errors.append("output.dir is empty; name a folder for this run, e.g. output.dir=outputs/my_run")
        if self.export_merged and not self.export:
            errors.append(
                "output.export_merged=true needs output.export=true (the merged model is written with the final "
                "export); set output.export=true, or drop export_merged and run `finetune export --merge` later"
            )
        unknown = [name for name in self.trackers if name not in TRACKERS]
        if unknown:
            errors.append(f"output.trackers names {', '.join(unknown)}; use any of {', '.join(TRACKERS)}")
        return errors


@dataclass(kw_only=True)
class GenerateConfig:
    """Evaluation by generation (`finetune.rollouts.generation`): held-out prompts answered greedily at every
    evaluation."""

    samples: int = 200
    """How many eval samples are answered: the first ones of the eval split."""

    max_new_tokens: int = 64
    """The longest completion generated."""

    metric: Literal["exact_match", "contains"] = "exact_match"
    """`exact_match`: the completion (without special tokens, stripped) equals the reference; `contains`: the
    reference appears in it."""

    column: str | None = None
    """The column holding each sample's reference; unset: the conversation's last assistant turn, or the
    completion of a prompt/completion sample."""

    def errors(self) -> list[str]:
        errors = []
        for name in ("samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                errors.append(f"eval.generate.{name} must be >= 1, got {getattr(self, name)}")
        return errors


@dataclass(kw_only=True)
class EvalConfig:
    """What an evaluation measures besides the objective's loss."""

    generate: GenerateConfig | None = None
    """Answer held-out prompts by generation and score them (`finetune.rollouts.generation`); unset: loss only."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every_steps: int = field(default=0, metadata={NEVER: 0})
    """Save a checkpoint every this many optimizer steps and at the last step (0 or null = no checkpoints)."""

    keep_last: int = 2
    """Complete checkpoints to keep; older ones are deleted after each successful save."""

    resume: str | None = None
    """`auto`: continue from the latest complete checkpoint in output.dir (or start fresh if there is
    none); or the path of a `step_<N>` checkpoint folder."""

    async_save: bool = False
    """Write checkpoints in the background (DCP's asynchronous save; FSDP2 with SHARDED_STATE_DICT, full
    fine-tuning): training stops only while the state is copied to host memory. A checkpoint is marked
    complete only once every rank's writes ended, before the next save starts or at the end."""

    def errors(self) -> list[str]:
        errors = []
        if self.save_every_steps < 0:
            errors.append(f"checkpoint.save_every_steps must be >= 0, got {self.save_every_steps}")
        if self.keep_last < 1:
            errors.append(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        return errors


@dataclass(kw_only=True)
class PeftConfig:
    """Parameter-efficient fine-tuning: train low-rank adapters on a frozen base (absent = full fine-tuning)."""

    method: Literal["lora", "dora"] = "lora"
    """lora, or dora (LoRA plus a trained magnitude per output feature: weight-decomposed LoRA)."""

    r: int = 16
    """Rank of each adapter's update B @ A."""

    alpha: float = 32.0
    """The update is scaled by alpha / r (alpha / sqrt(r) with use_rslora)."""

    dropout: float = 0.0
    """Dropout on each adapter's input, while training."""

    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters, by name (e.g. [q_proj, k_proj, v_proj, o_proj]): linear layers, embeddings
    (embed_tokens) and GPT-2's Conv1D; [all-linear] (or all-linear, PEFT's spelling) for every linear layer
    but the output head: of a mixture of experts, attention, dense MLPs and shared experts, never its routers
    or routed experts (which PEFT 0.21's all-linear adapts too). A list value may be written as one name."""

    target_experts: bool = False
    """Of a mixture of experts, also adapt the routed experts of every MoE layer: each fused expert weight
    (gate_up_proj, down_proj: experts x out x in) gets a low-rank update per expert, through PEFT's
    target_parameters. LoRA without dropout only (PEFT cannot adapt a parameter with either)."""

    target_parameters: list[str] = field(default_factory=list)
    """Parameters to adapt by name, as PEFT's target_parameters: a name ending a parameter's full name, e.g.
    [7.mlp.experts.gate_up_proj, 7.mlp.experts.down_proj] for one layer's experts (target_experts: all of
    them). Same limits as target_experts."""

    use_rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r), which keeps high ranks from learning more slowly."""

    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters and saved with them, e.g. [lm_head] (not on tied embeddings)."""

    quantization: Literal["none", "nf4"] = "none"
    """nf4: QLoRA. The frozen base's linear layers are stored in 4 bits (NormalFloat with double
    quantization, bitsandbytes), packed in storage of the compute dtype (the accelerate config's mixed
    precision, else `model.dtype`) so that FSDP shards them like any weight and casts nothing; they
    compute in that dtype. none: the base keeps `model.dtype`."""

    def errors(self) -> list[str]:
        errors = []
        if self.r < 1:
            errors.append(f"peft.r must be >= 1, got {self.r}")
        if self.alpha <= 0:
            errors.append(f"peft.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"peft.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or ("all-linear" in self.target_modules and len(self.target_modules) > 1):
            errors.append("peft.target_modules must be a list of module names, or [all-linear] alone")
        if self.target_experts or self.target_parameters:
            asked = "peft.target_experts" if self.target_experts else "peft.target_parameters"
            if self.method != "lora":
                errors.append(f"{asked} adapts parameters with LoRA only; set peft.method: lora")
            if self.dropout:
                errors.append(f"{asked} cannot apply dropout to a parameter's adapter; set peft.dropout: 0")
        return errors


@dataclass(kw_only=True)
class PreferenceConfig:
    """Preference tuning on chosen/rejected pairs (absent: supervised fine-tuning); finetune.objectives.preference."""

    loss: Literal["dpo", "ipo", "simpo", "orpo", "kto"] = "dpo"
    """dpo: the sigmoid loss of Rafailov et al. on summed log-ratios to the reference; ipo: the squared loss of
    Azar et al. on per-token log-ratios; simpo: reference-free, per-token log-probabilities with a target
    margin; orpo: reference-free, the chosen reply's likelihood plus its odds ratio over the rejected one; kto:
    Ethayarajh et al.'s loss on unpaired desirable and undesirable completions (pairs are split into one of
    each), each log-ratio to the reference compared with a reference point (finetune.objectives.kto)."""

    beta: float = 0.1
    """Strength of the preference term: DPO/IPO's KL weight (IPO's tau), SimPO's reward scale, ORPO's
    odds-ratio weight (its lambda). Must be > 0."""

    label_smoothing: float = 0.0
    """dpo and simpo: the probability that a pair's labels are flipped (conservative DPO); in [0, 0.5)."""

    simpo_gamma: float | None = None
    """simpo only: the target reward margin gamma (default 0.5)."""

    sft_weight: float = 0.0
    """Adds this x the chosen reply's mean negative log-likelihood to each pair's loss (RPO; TRL's `sft` term)."""

    desirable_weight: float | None = None
    """kto only: the weight of each desirable sample's loss (> 0; default 1). Ethayarajh et al. keep
    (desirable_weight x desirable samples) / (undesirable_weight x undesirable samples) between 1 and 4/3."""

    undesirable_weight: float | None = None
    """kto only: the weight of each undesirable sample's loss (> 0; default 1)."""

    reference: Literal["auto", "precomputed", "model", "none"] = "auto"
    """Where DPO/IPO/KTO's reference log-probabilities come from: precomputed (the initial weights' values for every
    pair, computed once before the first step and stored with the data; auto for full fine-tuning), the same
    model with its adapters off (auto with a peft section), model (a second frozen copy: `reference_model`),
    none (simpo and orpo, auto for them)."""

    reference_model: str | None = None
    """reference: model: the hub id or folder of the reference model."""

    @property
    def gamma(self) -> float:
        return 0.5 if self.simpo_gamma is None else self.simpo_gamma

    @property
    def weights(self) -> tuple[float, float]:
        """kto: the desirable and the undesirable samples' loss weights."""
        return (
            1.0 if self.desirable_weight is None else self.desirable_weight,
            1.0 if self.undesirable_weight is None else self.undesirable_weight,
        )

    @property
    def reference_free(self) -> bool:
        return self.loss in ("simpo", "orpo")

    def resolved_reference(self, base_switch: bool) -> str:
        """The reference a run uses: precomputed, adapters (the model with its adapters off, where the weights have
        that `base_switch`), model or none."""
        if self.reference != "auto":
            return self.reference
        if self.reference_free:
            return "none"
        return "adapters" if base_switch else "precomputed"

    def errors(self) -> list[str]:
        errors = []
        if self.beta <= 0:
            errors.append(f"preference.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            errors.append(f"preference.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss not in ("dpo", "simpo"):
            errors.append(f"preference.label_smoothing applies to dpo and simpo, not {self.loss}; remove it")
        if self.simpo_gamma is not None and self.loss != "simpo":
            errors.append(f"preference.simpo_gamma applies to loss: simpo, not {self.loss}; remove it")
        if self.sft_weight < 0:
            errors.append(f"preference.sft_weight must be >= 0, got {self.sft_weight}")
        if self.sft_weight and self.loss == "kto":
            errors.append("preference.sft_weight adds to a pair's loss, and kto has no pairs; remove it")
        for name in ("desirable_weight", "undesirable_weight"):
            weight = getattr(self, name)
            if weight is not None and self.loss != "kto":
                errors.append(f"preference.{name} applies to loss: kto, not {self.loss}; remove it")
            elif weight is not None and weight <= 0:
                errors.append(f"preference.{name} must be > 0, got {weight}")
        if self.reference_free and self.reference not in ("auto", "none"):
            errors.append(
                f"preference.loss={self.loss} uses no reference model; set preference.reference=auto (or none)"
            )
        if not self.reference_free and self.reference == "none":
            errors.append(f"preference.loss={self.loss} compares with a reference; set preference.reference=auto")
        if self.reference == "model" and not self.reference_model:
            errors.append("preference.reference=model needs preference.reference_model (a hub id or folder)")
        if self.reference_model and self.reference != "model":
            errors.append("preference.reference_model is read with preference.reference=model only; set both or none")
        return errors


BUILTIN_REWARDS = ("exact_match", "regex", "overlong")


@dataclass(kw_only=True)
class RewardModelConfig:
    """A reward model trained on chosen/rejected pairs (absent: another objective; finetune.objectives.reward_model):
    the causal LM's last hidden state through a scalar head (`score`), exported as a sequence classifier with one
    label."""

    center_rewards_coefficient: float | None = None
    """Adds this x (r_chosen + r_rejected)^2 to each pair's loss, so that rewards stay centred on 0 (Eisenstein et
    al., 2023; TRL's setting of the same name, 0.01 in its examples); unset: off."""

    def errors(self) -> list[str]:
        coefficient = self.center_rewards_coefficient
        if coefficient is not None and coefficient < 0:
            return [f"reward_model.center_rewards_coefficient must be >= 0 (or left out), got {coefficient}"]
        return []


@dataclass(kw_only=True)
class RewardConfig:
    """One reward of online RL (`finetune.rollouts.rewards`): a built-in by name, a function of your own, or a
    reward model's folder."""

    function: str | None = None
    """`exact_match` (the completion, or what `pattern` extracts from it, equals the `column`'s value; both
    stripped), `regex` (1.0 when the completion matches `pattern` whole, else 0.0), or `module:function`, called
    as TRL calls a reward function: `prompts=`, `completions=`, `completion_ids=` and every other column of the
    data as keyword arguments, returning a float (or None: not scored) per completion. Or, instead, `model`."""

    model: str | None = None
    """A reward model's folder or hub id (a sequence classifier with one label, as a `reward_model` run exports it):
    each episode rendered with its own tokenizer and chat template and scored raw, the model frozen and sharded with
    the policy's per-layer units (`finetune.rollouts.reward_model`)."""

    max_length: int | None = None
    """model: the longest rendering scored; a longer one is scored on its last max_length tokens (its start cut,
    never its end, where the score is read) and counted in rewards/<name>/truncated. Unset: the reward model's
    max_position_embeddings."""

    micro_batch_size: int | None = None
    """model: renderings per forward; unset: the policy's rows per rollout micro-batch (train.micro_batch_size x
    rl.num_generations)."""

    weight: float = 1.0
    """The reward's weight in the sum that is normalized into advantages."""

    column: str | None = None
    """exact_match: the column holding each prompt's reference answer; unset: `answer`."""

    pattern: str | None = None
    """regex: the regular expression a completion must match whole (`re.fullmatch`, `.` matching newlines);
    exact_match: extracts the answer to compare (its last match's first group, e.g. `#### (\\S+)` for
    GSM8K's answers)."""

    cache: int | None = None
    """overlong: the tokens before rl.max_new_tokens over which its penalty falls from 0 to -1 (DAPO's soft
    overlong punishment: 4,096 of 20,480 in its paper), so that a completion that runs long loses reward before
    it is cut."""

    label: str | None = None
    """Its name in the metrics (rewards/<label>/mean); unset: the function's name."""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return self.function.rpartition(":")[2] if self.function else Path(self.model or "").name

    def errors(self) -> list[str]:
        if (self.function is None) == (self.model is None):
            return ["rl.rewards: each reward is a function or a model (a reward model's folder); give one of them"]
        if self.model is not None:
            given = [name for name in ("column", "pattern", "cache") if getattr(self, name) is not None]
            errors = [f"rl.rewards: {name} applies to a function, not to a reward model; remove it" for name in given]
            for name in ("max_length", "micro_batch_size"):
                if (value := getattr(self, name)) is not None and value < 1:
                    errors.append(f"rl.rewards: {name} must be >= 1, got {value}")
            return errors
        errors = [f"rl.rewards: {name} applies to a reward model; remove it (or give the model)"
                  for name in ("max_length", "micro_batch_size") if getattr(self, name) is not None]  # fmt: skip
        if self.function not in BUILTIN_REWARDS and not re.fullmatch(r"[\w.]+:[\w.]+", self.function):
            errors.append(
                f"rl.rewards: function={self.function} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                "module:function (e.g. my_rewards:correct)"
            )
        if self.function == "regex" and not self.pattern:
            errors.append("rl.rewards: function=regex needs a pattern, the regular expression completions must match")
        if self.function == "overlong" and (self.cache is None or self.cache < 1):
            errors.append(
                f"rl.rewards: function=overlong needs cache >= 1 (got {self.cache}), the tokens before "
                "rl.max_new_tokens over which its penalty falls from 0 to -1 (e.g. a fifth of max_new_tokens)"
            )
        if self.function != "overlong" and self.cache is not None:
            errors.append(f"rl.rewards: cache is overlong's setting, and {self.function} reads none; remove it")
        if self.function == "overlong" and (self.column is not None or self.pattern is not None):
            errors.append("rl.rewards: function=overlong measures the completion's length and reads no column or "
                          "pattern; remove them")  # fmt: skip
        if self.function not in BUILTIN_REWARDS:
            given = [name for name in ("column", "pattern") if getattr(self, name) is not None]
            if given:
                errors.append(
                    f"rl.rewards: {self.function} is a function of your own, and {' and '.join(given)} apply to the "
                    "built-ins only (nothing would read them); remove them, and read the data's columns in the "
                    "function (they come as keyword arguments)"
                )
        elif self.function == "regex" and self.column is not None:
            errors.append(
                "rl.rewards: function=regex matches the completion against its pattern and reads no column; remove "
                "column (exact_match compares with a column)"
            )
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                errors.append(f"rl.rewards: pattern {self.pattern!r} is not a regular expression ({exc}); fix it")
        return errors


@dataclass(kw_only=True)
class RLConfig:
    """Online reinforcement learning with verifiable rewards (GRPO and its variants; finetune.objectives.grpo):
    each prompt's completions sampled by the model as it trains, scored, and reinforced by their advantage over
    the others of their group."""

    rewards: list[RewardConfig]
    """What scores a completion: the weighted sum of these (built-ins or functions of your own)."""

    num_generations: int = 8
    """Completions sampled per prompt: a group, whose rewards are compared with each other."""

    max_new_tokens: int = 256
    """The longest completion; data.max_length must leave this much room after every prompt."""

    temperature: float = 1.0
    """Sampling temperature; the log-probabilities trained are of the logits divided by it, as sampled."""

    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities add up to this."""

    rollout_cache: Literal["dynamic", "static"] = "dynamic"
    """The rollouts' KV cache: `dynamic` grows by a token a step (transformers' DynamicCache; a rollout's rows
    leave it as they end); `static` is allocated once and written in place (finetune/rollouts/static_decode.py), so the
    decoding step is compiled once and, on a GPU without per-layer gathering, replayed as a CUDA graph; rows leave
    it by halves. The same tokens either way (to float rounding: a static row attends over its whole cache)."""

    loss: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "dapo"
    """How per-token losses become a step's loss, as TRL defines them: grpo (each completion's mean, averaged over
    completions), dapo (averaged over every completion token of the step), dr_grpo (each completion's sum over
    max_new_tokens, averaged over completions); gspo (grpo's, with one importance ratio per completion: the
    exponent of its tokens' mean log-ratio; needs rl.epsilon, GSPO's is 3e-4), cispo (dapo's average of each token's
    log-probability times its advantage, weighted by its ratio clipped above at 1 + rl.epsilon_high and held
    constant: clipped tokens still train; needs rl.epsilon_high)."""

    epsilon: float | None = None
    """The importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]; unset: 0.2 (gspo needs its own: its
    ratios are of whole completions and stay close to 1; cispo clips above only)."""

    epsilon_high: float | None = None
    """The upper clipping bound's epsilon (DAPO's clip-higher, e.g. 0.28); unset: epsilon. cispo's weights are
    clipped at 1 + epsilon_high (TRL's `epsilon_high` for cispo is the bound itself: 1 more than this)."""

    beta: float = 0.0
    """Weight of the KL penalty to the reference (the adapters switched off, or the initial weights); 0: none and
    no reference computed, as DAPO and Dr. GRPO."""

    num_iterations: int = 1
    """Optimizer steps per rollout: each batch of completions is trained on this many times, importance-weighted
    against the log-probabilities it was sampled with (PPO's epochs, GRPO's mu)."""

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages are rewards minus their group's mean, divided by the group's standard deviation (group), the
    whole step's (batch) or nothing (none, Dr. GRPO)."""

    mask_truncated: bool = False
    """Completions cut at max_new_tokens train nothing (DAPO's overlong filtering)."""

    dynamic_sampling_rounds: int = 0
    """DAPO's dynamic sampling: a group whose rewards all tie teaches nothing, so up to this many more rounds of
    prompts (a step's worth each, drawn from the data as the next steps would) are answered until the step has
    train.global_batch_size prompts whose groups' rewards differ; 0: off, every prompt drawn is trained."""

    tools: list[str] = field(default_factory=list)
    """Agents (finetune/rollouts/episodes.py): Python functions the model may call, as `module:function` (TRL's
    `tools`); each is offered through the chat template's `tools` with the JSON schema of its signature and
    docstring, and a completion becomes an episode of turns, the calls between them run and answered."""

    environment_factory: str | None = None
    """Agents: `module:callable` returning a fresh environment per episode (TRL's `environment_factory`):
    `reset(**row)` before it, its public methods as tools, `get_reward()` optionally (a reward), `close()` after."""

    max_turns: int = 8
    """Agents: the most model turns in an episode (an episode still calling tools at the last ends there)."""

    tool_timeout: float = 30.0
    """Agents: seconds a tool call may take; past it the model reads a timeout error as the call's result."""

    episode_timeout: float | None = None
    """Agents: seconds an episode's tool calls may take in all (a turn's calls run at once: the turn takes its
    slowest); a call is given what is left, and once nothing is, the model reads a timeout error for each call it
    makes, no tool run. null: only rl.tool_timeout bounds them."""

    unfinished_reward: float | None = None
    """Agents: the reward of an episode that ends without an answer (its calls unreadable, at rl.max_turns, or at
    rl.max_new_tokens), instead of the rewards' (logged as rewards/unfinished); null: the rewards score it as any
    other (it has no final answer: exact_match gives it 0)."""

    @property
    def agents(self) -> bool:
        """Completions are episodes that call tools."""
        return bool(self.tools) or self.environment_factory is not None

    @property
    def lower_epsilon(self) -> float:
        return 0.2 if self.epsilon is None else self.epsilon

    @property
    def upper_epsilon(self) -> float:
        return self.lower_epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def per_token(self) -> bool:
        """The step's loss is a mean over completion tokens (dapo, cispo), else over completions."""
        return self.loss in ("dapo", "cispo")

    def errors(self) -> list[str]:
        errors = []
        if self.num_generations < 2:
            errors.append(
                f"rl.num_generations must be >= 2, got {self.num_generations}: advantages compare each completion "
                "with the others sampled for its prompt"
            )
        for name in ("max_new_tokens", "num_iterations"):
            if getattr(self, name) < 1:
                errors.append(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.dynamic_sampling_rounds < 0:
            errors.append(
                f"rl.dynamic_sampling_rounds must be >= 0 (0: off), got {self.dynamic_sampling_rounds}: the most "
                "rounds of prompts drawn for a step beyond its own"
            )
        if self.temperature <= 0:
            errors.append(
                f"rl.temperature must be > 0, got {self.temperature} (it samples; greedy is eval.generate's)"
            )
        if not 0 < self.top_p <= 1:
            errors.append(f"rl.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.lower_epsilon < 1 or self.upper_epsilon < 0:
            errors.append(f"rl.epsilon must be in [0, 1) and rl.epsilon_high >= 0, got {self.epsilon}, "
                          f"{self.epsilon_high}")  # fmt: skip
        if self.loss == "gspo" and self.epsilon is None:
            errors.append(
                "rl.loss=gspo clips each completion's ratio, the mean of its tokens', which stays within a hair of 1: "
                "the token losses' default rl.epsilon of 0.2 would never clip; set rl.epsilon and rl.epsilon_high "
                "(GSPO's are 3e-4 and 4e-4)"
            )
        if self.loss == "cispo" and (self.epsilon_high is None or self.epsilon is not None):
            errors.append(
                "rl.loss=cispo clips the importance weights above only, at 1 + rl.epsilon_high: set rl.epsilon_high "
                "(e.g. 4.0, a weight of at most 5)"
                + (" and remove rl.epsilon, which it does not read" if self.epsilon is not None else "")
            )
        if self.beta < 0:
            errors.append(f"rl.beta must be >= 0, got {self.beta}")
        if self.max_turns < 1:
            errors.append(f"rl.max_turns must be >= 1, got {self.max_turns}: the most model turns in an episode")
        if self.tool_timeout <= 0:
            errors.append(f"rl.tool_timeout must be > 0 seconds, got {self.tool_timeout}")
        if self.episode_timeout is not None and self.episode_timeout <= 0:
            errors.append(f"rl.episode_timeout must be > 0 seconds (or null), got {self.episode_timeout}")
        if self.episode_timeout is not None and not self.agents:
            errors.append("rl.episode_timeout bounds the tool calls of episodes, and this run makes none: remove it")
        if self.unfinished_reward is not None and not self.agents:
            errors.append(
                "rl.unfinished_reward scores episodes that end without an answer, and this run has none (no rl.tools "
                "or rl.environment_factory): remove it"
            )
        if not self.rewards and self.environment_factory is None:
            errors.append("rl.rewards is empty; name at least one, e.g. [{function: exact_match, column: answer}]")
        for reward in self.rewards:
            if reward.function == "overlong" and (reward.cache or 0) > self.max_new_tokens:
                errors.append(
                    f"rl.rewards: overlong's cache={reward.cache} is longer than rl.max_new_tokens="
                    f"{self.max_new_tokens}, where its penalty reaches -1; set it to at most {self.max_new_tokens}"
                )
        return errors


@dataclass(kw_only=True)
class DistillConfig:
    """Distillation (finetune.objectives.distill): a frozen teacher's next-token distributions taught to the model,
    on the data's replies (off-policy) and on the model's own completions of the data's prompts (on-policy)."""

    teacher: str
    """The teacher: a hub id or folder of a model with the student's tokenizer (usually a larger one of its family),
    loaded frozen and sharded per layer as the student is."""

    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "jsd"
    """Per trained token, over the vocabulary: forward_kl (KL(teacher || student): every token the teacher would
    say covered), reverse_kl (KL(student || teacher): the student's own choices graded, mode-seeking; what
    on-policy distillation usually trains), jsd (the generalized Jensen-Shannon divergence of GKD, weighted by
    `beta`). TRL's GKDTrainer's beta 0, 1 and in between."""

    beta: float = 0.5
    """jsd only: the teacher's weight in the mixture both are compared with, in (0, 1)."""

    temperature: float = 1.0
    """Both models' logits are divided by it before the divergence, and on-policy completions are sampled at it."""

    on_policy_fraction: float = 0.0
    """The share of steps trained on the model's own completions of their prompts (each step drawn from the run's
    seed, the same on any process count): 0, the data's replies only; 1, completions only (GKD's lambda)."""

    teacher_config_file: str | None = None
    """The teacher's config.json shipped with the recipe, for `finetune plan` and `check` offline (as
    model.config_file); training loads the teacher's own."""

    max_new_tokens: int | None = None
    """On-policy steps: the longest completion (and never past data.max_length). Required when on_policy_fraction
    is above 0."""

    sft_weight: float = 0.0
    """Adds this x the cross-entropy of the trained tokens (the data's replies, or the model's own completions) to
    each token's divergence."""

    estimator: Literal["full", "sampled"] = "full"
    """full: the divergence over the whole vocabulary at every trained token. sampled: reverse KL estimated at the
    tokens the student sampled alone (on-policy distillation's cheap form): each token's log q(x) - log p(x), the
    student's log-probability of what it wrote minus the teacher's, trains as a negative advantage with the
    policy-gradient loss, whose expected gradient is the reverse KL's; the teacher gives the sampled tokens'
    log-probabilities only, no vocabulary-wide distribution. Needs divergence: reverse_kl and on_policy_fraction: 1
    (only the student's own samples are drawn from it); start it from a student trained by SFT."""

    teacher_top_k: int | None = None
    """Off-policy only: the teacher's k most likely tokens at every trained position, with their log-probabilities,
    computed once before the first step and cached beside the tokenized data under a key of the teacher's weights,
    the rows and k (`finetune.objectives.teacher_table`); the divergence is then taken over those k tokens, both
    distributions renormalized on them, and no teacher is in memory while training. None: the teacher runs beside
    the student at every step, over the whole vocabulary."""

    def errors(self) -> list[str]:
        errors = []
        if self.teacher_top_k is not None and self.teacher_top_k < 1:
            errors.append(f"distill.teacher_top_k must be >= 1 (the teacher's tokens kept per position), got "
                          f"{self.teacher_top_k}; or remove it to run the teacher at every step")  # fmt: skip
        if self.teacher_top_k is not None and self.on_policy_fraction > 0:
            errors.append(
                "distill.teacher_top_k precomputes the teacher on the data's replies, but on-policy steps need it to "
                "grade the student's own completions, which no table holds; remove teacher_top_k, or set "
                "distill.on_policy_fraction=0"
            )
        if self.divergence == "jsd" and not 0 < self.beta < 1:
            errors.append(
                f"distill.beta must be in (0, 1) for divergence: jsd, got {self.beta}; its ends are divergence: "
                "forward_kl (0) and reverse_kl (1)"
            )
        if self.divergence != "jsd" and self.beta != 0.5:
            errors.append(f"distill.beta weighs divergence: jsd, not {self.divergence}; remove it")
        if self.temperature <= 0:
            errors.append(f"distill.temperature must be > 0, got {self.temperature}")
        if not 0 <= self.on_policy_fraction <= 1:
            errors.append(
                f"distill.on_policy_fraction must be in [0, 1] (the share of steps on the model's own completions), "
                f"got {self.on_policy_fraction}"
            )
        if self.on_policy_fraction > 0 and self.max_new_tokens is None:
            errors.append(
                "distill.on_policy_fraction > 0 samples completions: set distill.max_new_tokens (their longest)"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            errors.append(f"distill.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_new_tokens is not None and self.on_policy_fraction == 0:
            errors.append("distill.max_new_tokens is read by on-policy steps only (distill.on_policy_fraction > 0); "
                          "remove it or set both")  # fmt: skip
        if self.sft_weight < 0:
            errors.append(f"distill.sft_weight must be >= 0, got {self.sft_weight}")
        if self.estimator == "sampled":
            errors += self._sampled_errors()
        return errors

    def _sampled_errors(self) -> list[str]:
        """What the sampled estimator needs: reverse KL, of the student's own samples alone."""
        errors = []
        if self.divergence != "reverse_kl":
            errors.append(
                f"distill.estimator: sampled estimates KL(student || teacher) from the tokens the student sampled, "
                f"which is divergence: reverse_kl, not {self.divergence}; set distill.divergence: reverse_kl, or "
                "distill.estimator: full"
            )
        if self.on_policy_fraction != 1:
            errors.append(
                f"distill.estimator: sampled grades tokens the student sampled, but on_policy_fraction="
                f"{self.on_policy_fraction} trains some steps on the data's replies, which it did not sample; set "
                "distill.on_policy_fraction: 1 (train the student by SFT first for a warm start), or "
                "distill.estimator: full"
            )
        if self.sft_weight > 0:
            errors.append(
                "distill.sft_weight adds the cross-entropy of the trained tokens, which with distill.estimator: "
                "sampled are the student's own samples (it would only sharpen what it already says); remove it"
            )
        return errors


@dataclass(kw_only=True)
class RecipeConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    output: OutputConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig | None = None
    preference: PreferenceConfig | None = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    rl: RLConfig | None = None
    distill: DistillConfig | None = None
    reward_model: RewardModelConfig | None = None

    @property
    def pairs_section(self) -> str | None:
        """The section of a run that trains on chosen/rejected pairs (preference or reward_model), or None."""
        if self.preference is not None:
            return "preference"
        return "reward_model" if self.reward_model is not None else None

    def cross_field_errors(self) -> list[str]:
        """Problems that involve more than one section, each with its fix (each section checks its own fields)."""
        errors = []
        steps, max_steps = self.train.profile_steps, self.train.max_steps
        if len(steps) == 2 and max_steps is not None and steps[0] > max_steps:
            errors.append(
                f"train.profile_steps={steps} starts after the last step ({max_steps}), so nothing would be "
                f"recorded; profile steps within 1..{max_steps}"
            )
        if self.peft is None and self.output.export_merged:
            errors.append("output.export_merged applies to adapter runs (a peft section); remove it")
        objective = self.train.objective
        if objective is not None and not re.fullmatch(r"[\w.]+:[\w.]+", objective):
            errors.append(f"train.objective={objective} is not module:attribute (e.g. mypackage.losses:Weighted)")
        if objective is not None and self.preference is not None:
            errors.append("train.objective names an objective of its own; remove it or the preference section")
        if self.eval.generate is not None and not (self.data.eval_path or self.data.eval_fraction > 0):
            errors.append(
                "eval.generate answers held-out prompts, and there is no eval data; set data.eval_path or "
                "data.eval_fraction"
            )
        if self.pairs_section is None and self.data.format == "preference":
            errors.append("data.format=preference trains on pairs: add a preference section, e.g. preference.loss=dpo")
        return errors + self._pairs_errors() + self._rl_errors() + self._distill_errors() + self._reward_model_errors()

    def _pairs_errors(self) -> list[str]:
        """A run on pairs (a preference or reward_model section) against the data settings it cannot honour."""
        section = self.pairs_section
        if section is None:
            return []
        errors = []
        compares = {
            "preference": "the log-probabilities of the two replies to one prompt",
            "reward_model": "the scores of the two replies to one prompt",
        }[section]
        if self.data.format not in ("auto", "preference"):
            errors.append(
                f"a {section} section trains on pairs, not data.format={self.data.format}; set data.format=auto"
            )
        if self.data.packing_window is not None:
            errors.append(
                f"data.packing_window applies to supervised fine-tuning; a {section} run packs each micro-batch's "
                "pairs together (rows of about equal length), so remove it"
            )
        if not self.data.completion_only_loss:
            errors.append(
                f"data.completion_only_loss=false trains prompts too, which a {section} run cannot: its loss compares "
                f"{compares}; remove it (SFT on the prompts is a separate supervised run)"
            )
        if self.data.multi_turn != "full":
            errors.append(
                f"data.multi_turn={self.data.multi_turn} applies to supervised chat data; a {section} run compares "
                "each side's completion (every reply after the prompt both sides share), so remove it"
            )
        return errors

    def _reward_model_errors(self) -> list[str]:
        """A reward_model section against the rest of the recipe."""
        if self.reward_model is None:
            return []
        sections = {"preference": self.preference, "rl": self.rl, "distill": self.distill,
                    "train.objective": self.train.objective}  # fmt: skip
        others = [name for name, value in sections.items() if value is not None]
        if others:
            return [f"a reward_model section trains by its own objective; remove {' and '.join(others)}"]
        return []

    def _rl_errors(self) -> list[str]:
        """An rl section's settings against the rest of the recipe."""
        rl = self.rl
        if rl is None:
            return []
        errors = []
        if self.preference is not None or self.train.objective is not None:
            errors.append(
                "an rl section trains by its own objective; remove the preference section or train.objective"
            )
        if self.data.format != "auto":
            errors.append(f"an rl section samples completions to prompts (a `prompt` column), not data.format="
                          f"{self.data.format}; set data.format=auto")  # fmt: skip
        if self.data.packing:
            errors.append("an rl section trains on the completions it samples, in padded rows; set data.packing=false")
        # Settings of how supervised data is trained, which no sampled completion can honour: refused, not ignored.
        ignored = [
            f"{name}={str(value).lower() if isinstance(value, bool) else value}" for name, value, default in (
                ("train_on_reasoning", self.data.train_on_reasoning, True),
                ("completion_only_loss", self.data.completion_only_loss, True),
                ("multi_turn", self.data.multi_turn, "full"),
            ) if value != default
        ]  # fmt: skip
        if ignored:
            errors.append(
                f"data.{', data.'.join(ignored)} set how supervised replies train; an rl section trains every token "
                "of the completions it samples (their reasoning included) and never the prompt, so remove "
                f"{'them' if len(ignored) > 1 else 'it'}"
            )
        if self.data.max_length <= rl.max_new_tokens:
            errors.append(
                f"data.max_length={self.data.max_length} (prompt plus completion) leaves no room for prompts after "
                f"rl.max_new_tokens={rl.max_new_tokens}; raise data.max_length or lower rl.max_new_tokens"
            )
        every, save_every = rl.num_iterations, self.checkpoint.save_every_steps
        if every > 1 and save_every % every:
            errors.append(
                f"checkpoint.save_every_steps={save_every} must be a multiple of rl.num_iterations={every}: a "
                "checkpoint is taken between rollouts, where the run resumes exactly"
            )
        if every > 1 and self.train.max_steps is not None and self.train.max_steps % every:
            errors.append(
                f"train.max_steps={self.train.max_steps} must be a multiple of rl.num_iterations={every}, so that the "
                "last rollout is trained on as often as the others"
            )
        return errors

    def _distill_errors(self) -> list[str]:
        """A distill section's settings against the rest of the recipe."""
        distill = self.distill
        if distill is None:
            return []
        errors = []
        sections = {"preference": self.preference, "rl": self.rl, "train.objective": self.train.objective}
        others = [name for name, value in sections.items() if value is not None]
        if others:
            errors.append(f"a distill section trains by its own objective; remove {' and '.join(others)}")
        if self.data.format == "preference":
            errors.append("a distill section trains on sequences, not data.format=preference; set data.format=auto")
        if _same_model(distill.teacher, self.model.name_or_path):
            errors.append(
                f"distill.teacher is the student's own model ({distill.teacher}): it would teach what the student "
                "already knows (every divergence 0); set distill.teacher to the larger model to learn from"
            )
        new = distill.max_new_tokens
        if distill.on_policy_fraction > 0 and new is not None and self.data.max_length <= new:
            errors.append(
                f"data.max_length={self.data.max_length} (prompt plus completion) leaves no room for prompts after "
                f"distill.max_new_tokens={new}; raise data.max_length or lower distill.max_new_tokens"
            )
        return errors

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _same_model(first: str, second: str) -> bool:
    """Whether two model settings name one model: the same hub id, or folders that resolve to one place."""
    if first == second:
        return True
    a, b = Path(first).expanduser(), Path(second).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


# Keys renamed since they were introduced, (section, old) -> new: the old name keeps working, with a note.
RENAMED_KEYS = {("train", "loss"): "loss_path"}


def with_current_keys(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A recipe tree with every renamed key under its current name (a checkpoint's saved recipe too), and a
    note per key renamed."""
    notes = []
    for (section, old), new in RENAMED_KEYS.items():
        node = raw.get(section)
        if isinstance(node, dict) and old in node and new not in node:
            node[new] = node.pop(old)
            notes.append(f"{section}.{old} is now {section}.{new}; read as such (rename it in the recipe)")
    return raw, notes


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> RecipeConfig:
    """Read a recipe YAML, apply `section.key=value` overrides, and validate everything at once."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; pass the path of a YAML file under recipes/")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"recipe {path} must be a mapping of sections (model, data, optim, train, output, checkpoint)"
        )
    errors: list[str] = []
    for override in overrides or []:
        _apply_override(raw, override, errors)
    raw, notes = with_current_keys(raw)
    if os.environ.get("RANK", "0") == "0":  # said once, not by every process of a launch
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    recipe = _build(RecipeConfig, raw, "", errors)
    if recipe is not None and not errors:
        errors.extend(recipe.cross_field_errors())
    if errors:
        plural = "s" if len(errors) > 1 else ""
        raise ConfigError(f"{len(errors)} problem{plural} in {path}: " + "; ".join(errors))
    return recipe


def save_recipe(recipe: RecipeConfig, path: Path) -> None:
    """Write the resolved recipe, so a run's outputs always say exactly what produced them."""
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def _apply_override(raw: dict, override: str, errors: list[str]) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        errors.append(f"override {override!r} must look like section.key=value, e.g. optim.lr=1e-5")
        return
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            errors.append(f"override {override!r}: {part} is not a section")
            return
    try:
        node[leaf] = yaml.safe_load(value) if value else None
    except yaml.YAMLError as exc:
        # Text fields take it as written (an inline chat template is not YAML); any other field reports it.
        node[leaf] = _NotYaml(value, getattr(exc, "problem", None) or " ".join(str(exc).split()))


class _NotYaml(str):
    """An override value YAML cannot read: the text itself for a text field, an error for any other."""

    def __new__(cls, value: str, problem: str) -> _NotYaml:
        text = super().__new__(cls, value)
        text.problem = problem
        return text


def _build(cls: type, raw: Any, prefix: str, errors: list[str]) -> Any:
    """Instantiate dataclass `cls` from `raw`, appending every problem found to `errors`."""
    where = prefix.rstrip(".") or "the recipe"
    if not isinstance(raw, dict):
        errors.append(f"{where} must be a mapping, got {type(raw).__name__}")
        return None
    num_errors_before = len(errors)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            errors.append(f"unknown key {prefix}{key}{hint}")
    values, failed, complete = {}, [], True
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name in raw and raw[name] is None and NEVER in f.metadata:
            values[name] = f.metadata[NEVER]  # an interval left empty: never (what 0 says)
        elif name in raw:
            values[name] = _coerce(raw[name], hints[name], f"{prefix}{name}", errors)
            if values[name] is _INVALID:
                failed.append(name)
                complete = complete and not required
                del values[name]  # its default stands in, so that the section's other checks still run
        elif required:
            errors.append(f"missing required key {prefix}{name}")
            complete = False
    if not complete:
        return None
    built = cls(**values)
    if hasattr(built, "errors"):  # checks within the section; those about a field already reported are left out
        errors.extend(e for e in built.errors() if not any(f"{prefix}{name}" in e for name in failed))
    return None if len(errors) > num_errors_before else built


_INVALID = object()  # marks a value that failed its check; the error is already recorded


def _coerce(value: Any, hint: Any, name: str, errors: list[str]) -> Any:
    """Check `value` against type `hint`; numbers written as strings (YAML reads 1e-5 as one) are converted."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    takes_text = hint is str or (origin in (typing.Union, types.UnionType) and str in args)
    if isinstance(value, _NotYaml) and not takes_text:
        errors.append(f"{name}={value!s} is not valid YAML ({value.problem}); quote it or fix its brackets")
        return _INVALID
    if isinstance(value, _NotYaml):
        value = str(value)
    if dataclasses.is_dataclass(hint):
        built = _build(hint, value, name + ".", errors)
        return _INVALID if built is None else built
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, name, errors)
    if origin is Literal:
        if value in args:
            return value
        errors.append(f"{name} must be one of {', '.join(map(str, args))}; got {value!r}")
        return _INVALID
    if origin is list and dataclasses.is_dataclass(args[0]) and isinstance(value, list):
        built = [_build(args[0], item, f"{name}[{i}].", errors) for i, item in enumerate(value)]
        return _INVALID if None in built else built
    if origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]  # one name for a list of names (PEFT's own `target_modules="all-linear"`)
        if isinstance(value, list) and all(isinstance(v, args[0]) for v in value):
            return value
        errors.append(f"{name} must be a list of {args[0].__name__}, got {value!r}")
        return _INVALID
    if origin is dict and args[1] is Any:  # settings passed on as they are (model.config_overrides)
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        errors.append(f"{name} must be a mapping of names to values, got {value!r}")
        return _INVALID
    if origin is dict:
        nullable = type(None) in typing.get_args(args[1])  # dict[str, str | None]: null leaves a column out
        if isinstance(value, dict) and all(
            isinstance(k, str) and (isinstance(v, str) or (v is None and nullable)) for k, v in value.items()
        ):
            return value
        names = "names or null" if nullable else "names"
        errors.append(f"{name} must be a mapping of names to {names}, got {value!r}")
        return _INVALID
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint in (int, float):
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value) if hint is float else int(value)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and not math.isfinite(value):
            # .nan slips through every range check (all comparisons are false) and .inf through most.
            errors.append(f"{name} must be a finite number, got {value!r}")
            return _INVALID
        if number and (hint is float or value == int(value)):
            return hint(value)
    elif isinstance(value, hint):
        return value
    if value is None:
        errors.append(f"{name} is empty; give it {_a(hint.__name__)} value")
    else:
        errors.append(f"{name} must be {_a(hint.__name__)}, got {value!r}")
    return _INVALID


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
