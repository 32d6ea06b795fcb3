"""The build: a recipe becomes the run the loop steps, in named stages (read top to bottom in `build_run`).

    setup_accelerator   the launch's accelerator, seeded, and the activation-checkpointing policy
    setup_tokenizer     the tokenizer and chat template, checked against the model's vocabulary
    setup_model         the weights loaded (by rank 0 only under rank-0 loading), adapters added
    setup_data          the objective's samples, tokenized and batched
    fit_to_launch       the objective's model preparation, the wrap policy checked, rank 0's weights sent
    setup_optimizer     the optimizer, prepared with the model and the data
    setup_steps         the step count, checked against the checkpoint resumed and the steps profiled; the schedule
    setup_checkpoint_io what saves and restores the training state, and writes the model files
    setup_objective     the routers' balancing and the objective (with its reference), on the chosen loss path
    restore             a checkpoint's state, where the run resumes

What varies is chosen once, before the stages run: the objective's builder (`objectives.objective_for`) and the
weights (`weights.weights_for`: full, or adapters). No stage asks which objective runs or whether adapters are on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.config import ModelConfig, RecipeConfig
from finetune.data import Data, build_data, check_sources
from finetune.engine import attention, sequence
from finetune.engine.accelerator import build_accelerator, compute_dtype, rank_zero_loading
from finetune.engine.cpu_fsdp import broadcast_module_states
from finetune.engine.launch import environment_problems
from finetune.engine.recompute import Policy, offload_layer_inputs
from finetune.engine.wrap import validate_wrap_policy
from finetune.errors import FinetuneError
from finetune.export.model_files import save_model_files
from finetune.model.dropout import checkpoint_dropout_exactly
from finetune.model.kernels import check_kernels, fuse
from finetune.model.loading import (
    DTYPES,
    check_attention,
    check_max_length,
    check_mlp_tiling,
    check_model_path,
    check_packing,
    check_tied_weights,
    check_vocabulary,
    load_model,
    load_model_config,
    load_tokenizer,
    model_folder,
    tile_model_mlps,
)
from finetune.model.routing import check_experts_recipe, set_up_routing
from finetune.model.score_head import score_pad_id
from finetune.model.weights import StateIO, Weights, weights_for
from finetune.objectives import (
    BuildContext,
    Objective,
    ObjectiveBuilder,
    WithBalancingLoss,
    objective_for,
    with_rollout,
)
from finetune.objectives.loss import LossPath, choose_loss_path
from finetune.plan.verdict import recompute_policy
from finetune.rollouts.generation import GenerationEval
from finetune.run.optim import build_optimizer, build_scheduler
from finetune.storage.checkpoint import (
    TrainingState,
    check_resume_objective,
    check_resume_strategy,
    load_checkpoint,
    resolve_resume,
    step_of,
    tensor_names,
)
from finetune.storage.outputs import check_output_dir


@dataclass
class Run:
    """What training works with once everything is built, prepared and restored."""

    recipe: RecipeConfig
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    eval_loader: DataLoader | None
    max_steps: int
    accumulation: int
    """Micro-batches per process per optimizer step (`TrainConfig.accumulation` for this launch)."""
    output_dir: Path
    write_model_files: Callable[[Path], None]
    tensor_names: list[list[str]]
    save_state: Callable[[Path], Any]
    """Writes the training state into a checkpoint folder (collective): accelerate's, the adapters' only, or
    DCP's asynchronous save (which returns the futures of its background writes)."""
    loss_path: LossPath
    objective: Objective
    objective_name: str
    """Stored in every checkpoint (`ObjectiveBuilder.name`)."""
    start: TrainingState
    """Where training stands: step 0, or the restored checkpoint's step."""
    data: Data
    weights: Weights
    unit_noun: str
    started_on_meta: bool
    """Under rank-0 loading, this rank started without weights and received rank 0's."""
    choices: list[str | None]
    """Log lines of what the build chose (activation checkpointing, loss path, routing), if any."""
    write_objective_files: Callable[[], None]
    """Writes the objective's files into the output dir once it is claimed (main process)."""
    generation: GenerationEval | None = None
    """eval.generate: held-out prompts answered and scored at every evaluation, whatever the objective."""


def preflight(recipe: RecipeConfig) -> Path | None:
    """Everything about a run that can be checked before the model and data load (seconds, not
    minutes): the output dir, the checkpoint to resume (returned), the data paths, the length limit."""
    resume_from = resolve_resume(recipe.checkpoint.resume, Path(recipe.output.dir))
    check_output_dir(
        Path(recipe.output.dir), overwrite=recipe.output.overwrite, resume_from=resume_from,
        max_steps=recipe.train.max_steps,
    )  # fmt: skip
    check_sources(recipe.data)
    check_max_length(recipe.model, recipe.data.max_length)
    check_attention(recipe.model)
    check_mlp_tiling(recipe.model, recipe.train.mlp_tile_tokens)
    check_packing(recipe.model, recipe.data.packing)
    builder, weights = objective_for(recipe), weights_for(recipe)
    if builder.reference_model:  # a teacher or a preference reference: it scores the same rows
        check_model_path(builder.reference_model, builder.reference_setting)
        second = ModelConfig(name_or_path=builder.reference_model, trust_remote_code=recipe.model.trust_remote_code)
        check_max_length(second, recipe.data.max_length, builder.reference_setting)
    weights.preflight()
    config = load_model_config(recipe.model)
    check_kernels(recipe.model.kernels, config, recipe.model.name_or_path)
    check_experts_recipe(config, weights.quantization, recipe.train.router_aux_loss_coef, weights.expert_key)
    problems = environment_problems(recipe) + sequence.model_problems(config, sequence.launched_size())
    if problems:
        raise FinetuneError("; ".join(problems))
    if resume_from is not None:
        weights.check_resume(resume_from)
        check_resume_objective(resume_from, builder.name)
    return resume_from


def build_run(recipe: RecipeConfig, resume_from: Path | None) -> Run:
    """The run of `recipe` under the accelerate config this process was launched with, from `resume_from`
    (a checkpoint `preflight` chose) or from the start. Nothing is written to the output dir."""
    builder, weights = objective_for(recipe), weights_for(recipe)
    accelerator, policy, policy_line = setup_accelerator(recipe)
    tokenizer = setup_tokenizer(recipe, builder)
    reward_pad = tokenizer.pad_token_id if scores(builder) else None
    model, started_on_meta = setup_model(recipe, accelerator, policy, weights, resume_from, reward_pad)
    names = tensor_names(model)  # before FSDP renames or flattens anything; saved with every checkpoint
    data = setup_data(recipe, tokenizer, accelerator, builder)
    generation = setup_generation(recipe, data, tokenizer)
    fit_to_launch(model, accelerator, builder)
    model, optimizer, train_loader, eval_loader = setup_optimizer(recipe, accelerator, model, data, started_on_meta)
    accumulation = recipe.train.accumulation(sequence.data_parallel_size(accelerator))
    max_steps = setup_steps(recipe, train_loader, accumulation, resume_from)
    scheduler = build_scheduler(optimizer.optimizer, recipe.optim, max_steps)
    write_model_files, (save_state, load_state) = setup_checkpoint_io(
        recipe, accelerator, model, optimizer, tokenizer, weights
    )
    loss_path, loss_line = choose_loss_path(recipe.train.loss_path, accelerator.unwrap_model(model))
    if scores(builder):  # no logits: the head gives one number per sequence
        loss_line = "scores: the scalar head at each sequence's last token (the end of its reply)"
    objective, routing_line, write_objective_files = setup_objective(
        BuildContext(recipe, accelerator, model, data, loss_path, weights, resume_from, tokenizer), builder
    )
    start = restore(recipe, accelerator, scheduler, load_state, resume_from)
    return Run(
        recipe, accelerator, model, optimizer, scheduler, train_loader, eval_loader, max_steps, accumulation,
        Path(recipe.output.dir), write_model_files, names, save_state, loss_path, objective, builder.name, start,
        data, weights, builder.unit_noun, started_on_meta, [policy_line, loss_line, routing_line],
        write_objective_files, generation,
    )  # fmt: skip


def setup_generation(recipe: RecipeConfig, data: Data, tokenizer: PreTrainedTokenizerBase) -> GenerationEval | None:
    """eval.generate's prompts and scoring, or None (loss-only evaluation)."""
    generate = recipe.eval.generate
    if generate is None or not data.prompts:
        return None
    positions = getattr(load_model_config(recipe.model).get_text_config(), "max_position_embeddings", None)
    longest = max(len(prompt.ids) for prompt in data.prompts)
    if isinstance(positions, int) and longest + generate.max_new_tokens > positions:
        raise FinetuneError(
            f"eval.generate: the longest eval prompt ({longest:,} tokens) plus eval.generate.max_new_tokens="
            f"{generate.max_new_tokens:,} is more than the {positions:,} positions of {recipe.model.name_or_path}; "
            f"lower max_new_tokens to {positions - longest:,} or less, or evaluate on shorter prompts"
        )
    return GenerationEval(generate, data.prompts, tokenizer)


def setup_accelerator(recipe: RecipeConfig) -> tuple[Accelerator, Policy, str | None]:
    accelerator = build_accelerator(
        trackers=recipe.output.trackers,
        project_dir=str(Path(recipe.output.dir)),
        recipe_activation_checkpointing=recipe.train.recompute != "none",
        param_dtype=DTYPES[recipe.model.dtype],
    )
    set_seed(recipe.train.seed)
    sp = sequence.sequence_parallel(accelerator)
    attention.split_rows_over(sp.group if sp is not None else None)
    policy, policy_line = recompute_policy(recipe, accelerator)
    return accelerator, policy, policy_line


def setup_tokenizer(recipe: RecipeConfig, builder: ObjectiveBuilder) -> PreTrainedTokenizerBase:
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    setting = getattr(builder, "reference_setting", "the reference model")  # an objective of your own may lack it
    check_vocabulary(recipe.model, tokenizer, builder.reference_model, setting)
    if scores(builder):  # a reward model pads with an id no scored sequence ends with
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(score_pad_id(tokenizer, recipe.model.name_or_path))
    return tokenizer


def scores(builder: ObjectiveBuilder) -> bool:
    """Whether the objective trains a reward model (its model outputs a `score`, not a causal LM's logits)."""
    return getattr(builder, "head", "lm") == "score"


def setup_model(
    recipe: RecipeConfig,
    accelerator: Accelerator,
    policy: Policy,
    weights: Weights,
    resume_from: Path | None,
    reward_pad: int | None = None,
) -> tuple[torch.nn.Module, bool]:
    """The model as it trains, not yet sharded, and whether this rank started without its weights; with
    `reward_pad` (its pad id), a reward model (`finetune.model.score_head`)."""
    # Under rank-0 loading (cpu_ram_efficient_loading) only rank 0 reads the weights; the others
    # start on the meta device and receive them from rank 0 while the model is sharded.
    started_on_meta = rank_zero_loading() and not accelerator.is_main_process
    model = load_model(
        recipe.model, policy, read_weights=not started_on_meta, quantization=weights.load_quantization(accelerator),
        score_pad_id=reward_pad,
    )  # fmt: skip
    fused = fuse(model, recipe.model.kernels)
    if fused:
        accelerator.print(fused)
    tile_model_mlps(model, recipe.train.mlp_tile_tokens)
    if recipe.train.activation_offload:
        offload_layer_inputs(model)
    return weights.prepare(model, resume_from), started_on_meta


def setup_data(
    recipe: RecipeConfig, tokenizer: PreTrainedTokenizerBase, accelerator: Accelerator, builder: ObjectiveBuilder
) -> Data:
    sp = sequence.sequence_parallel(accelerator)
    return build_data(
        recipe.data, tokenizer, accelerator, seed=recipe.train.seed, micro_batch_size=recipe.train.micro_batch_size,
        samples=builder.samples, split=sp.split if sp is not None else None, generate=recipe.eval.generate,
    )  # fmt: skip


def fit_to_launch(model: torch.nn.Module, accelerator: Accelerator, builder: ObjectiveBuilder) -> None:
    """The model made ready to be sharded: the objective's preparation, the wrap policy checked against it, and
    (rank-0 loading) rank 0's weights sent to the others."""
    builder.prepare_model(model, accelerator)
    fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp_plugin is not None:
        validate_wrap_policy(fsdp_plugin, model)
        replaced = checkpoint_dropout_exactly(fsdp_plugin, model)
        if replaced:
            accelerator.print(replaced)
    broadcast_module_states(accelerator, model)


def setup_optimizer(
    recipe: RecipeConfig, accelerator: Accelerator, model: torch.nn.Module, data: Data, started_on_meta: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader, DataLoader | None]:
    """The model, its optimizer and the loaders, prepared by accelerate (the model sharded or wrapped)."""
    optimizer = build_optimizer(model.parameters(), recipe.optim, fused=accelerator.device.type in ("cuda", "cpu"))
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, data.train_loader)
    if started_on_meta:
        # accelerate hands the optimizer its sharded parameters by matching storage addresses, which
        # parameters on the meta device do not have (all are 0): rebind them in model order instead.
        optimizer.optimizer.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]
    eval_loader = accelerator.prepare(data.eval_loader) if data.eval_loader is not None else None
    check_tied_weights(accelerator.unwrap_model(model))
    return model, optimizer, train_loader, eval_loader


def setup_steps(recipe: RecipeConfig, train_loader: DataLoader, accumulation: int, resume_from: Path | None) -> int:
    """The run's optimizer steps, checked against the checkpoint it resumes and the steps it profiles (a
    `train.num_epochs` run learns its step count only here)."""
    max_steps = max_steps_of(recipe, train_loader, accumulation)
    if resume_from is not None and step_of(resume_from) > max_steps:
        raise FinetuneError(
            f"checkpoint {resume_from} is at step {step_of(resume_from)}, past the {max_steps} steps of "
            f"train.num_epochs={recipe.train.num_epochs}; raise train.num_epochs to continue"
        )
    profiled = recipe.train.profile_steps
    if profiled and profiled[0] > max_steps:
        raise FinetuneError(
            f"train.profile_steps={profiled} starts after the last step ({max_steps} steps of train.num_epochs="
            f"{recipe.train.num_epochs}), so nothing would be recorded; profile steps within 1..{max_steps}"
        )
    return max_steps


def max_steps_of(recipe: RecipeConfig, train_loader: DataLoader, accumulation: int) -> int:
    steps_per_epoch = len(train_loader) // accumulation
    if steps_per_epoch == 0:
        given = recipe.train.global_batch_size
        setting = (
            f"train.gradient_accumulation_steps={accumulation}" if given is None
            else f"the {accumulation} micro-batches a step of train.global_batch_size={given} takes on this launch"
        )  # fmt: skip
        raise FinetuneError(
            f"one epoch gives each process {len(train_loader)} micro-batches, fewer than {setting}; add data or "
            "lower it"
        )
    rounds = recipe.rl.dynamic_sampling_rounds if recipe.rl is not None else 0
    if steps_per_epoch < 1 + rounds:
        # A step would draw the same prompts twice: a group's noise depends on its round, so it would train them twice.
        raise FinetuneError(
            f"rl.dynamic_sampling_rounds={rounds} may draw {1 + rounds} steps' prompts for one step, and an epoch "
            f"holds {steps_per_epoch}: the step could answer a prompt twice; add prompts, or lower "
            "rl.dynamic_sampling_rounds or train.global_batch_size"
        )
    if recipe.train.max_steps is not None:
        return recipe.train.max_steps
    return max(1, math.ceil(recipe.train.num_epochs * steps_per_epoch))


def setup_checkpoint_io(
    recipe: RecipeConfig,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: PreTrainedTokenizerBase,
    weights: Weights,
) -> tuple[Callable[[Path], None], StateIO]:
    """What writes a checkpoint's model files (config, tokenizer, the adapter record), and the weights' state
    save and load."""
    write_model_files = functools.partial(
        save_model_files, accelerator.unwrap_model(model), tokenizer, weights.record,
        model_folder(recipe.model.name_or_path),
    )  # fmt: skip
    return write_model_files, weights.state_io(accelerator, model, optimizer, recipe.checkpoint.async_save)


def setup_objective(
    context: BuildContext, builder: ObjectiveBuilder
) -> tuple[Objective, str | None, Callable[[], None]]:
    """The objective (with the routers' balancing loss on a mixture of experts), the routing log line, and what
    writes the objective's files."""
    recipe, accelerator = context.recipe, context.accelerator
    # Before any forward (a precomputed reference's too): a mixture of experts routes in fp32 from here on.
    compute = compute_dtype(accelerator.mixed_precision, DTYPES[recipe.model.dtype])
    sp = sequence.sequence_parallel(accelerator)
    balancing, routing_line = set_up_routing(
        accelerator.unwrap_model(context.model), recipe.train.router_aux_loss_coef, compute,
        sp.group if sp is not None else None,
    )  # fmt: skip
    objective, write_files = builder.build(context)
    objective = with_rollout(objective)
    if balancing is not None:
        objective = WithBalancingLoss(objective, balancing)
    return objective, routing_line, write_files


def restore(
    recipe: RecipeConfig,
    accelerator: Accelerator,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    load_state: Callable[[Path], None],
    resume_from: Path | None,
) -> TrainingState:
    """Where training starts: step 0, or the state of the checkpoint it resumes (collective load)."""
    if resume_from is None:
        return TrainingState(0, 0, 0, accelerator.num_processes, recipe.model.name_or_path)
    # The launch's strategy is known for sure only here (preflight runs outside any launch too).
    check_resume_strategy(resume_from, fsdp=accelerator.distributed_type == DistributedType.FSDP)
    start = load_checkpoint(resume_from, recipe, load_state)
    scheduler.load_state_dict(start.scheduler)
    return start
