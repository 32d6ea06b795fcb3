"""The training loop: recipe -> accelerator -> model and data -> steps -> final checkpoint.

Loss normalization: each optimizer step minimizes (sum of token losses) / (target tokens in the
whole step, over all micro-batches and all processes). That is the same objective whether the
global batch is split 4x1x1 or 1x2x2 (micro-batch x accumulation x processes); a mean of
per-micro-batch means would weight short and long batches differently.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend, broadcast_object_list, set_seed
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from finetune import attention
from finetune.checkpoint import (
    PendingCheckpoint,
    TrainerState,
    async_save_state,
    check_resume_base,
    check_resume_kind,
    check_resume_objective,
    check_resume_strategy,
    checkpoints_root,
    finish_checkpoint,
    load_checkpoint,
    recipe_changes,
    resolve_resume,
    save_checkpoint,
    step_of,
    tensor_names,
)
from finetune.config import RecipeConfig, save_recipe
from finetune.data import Data, build_data, check_sources
from finetune.distributed import (
    PreemptionSignals,
    broadcast_module_states,
    build_accelerator,
    compute_dtype,
    local_params_fingerprint,
    precision_policy,
    rank_zero_loading,
    running_launch,
    shard_report,
    strategy_name,
)
from finetune.errors import FinetuneError
from finetune.fingerprint import sampled_fingerprint, weights_fingerprint
from finetune.flops import ModelFlops, model_flops, peak_flops
from finetune.launch import environment_problems
from finetune.loss import LossPath, choose_loss_path
from finetune.memory import MemoryProbe, format_reports, gather_reports, memory_metrics
from finetune.metrics import MetricsLogger
from finetune.model import (
    DTYPES,
    check_attention,
    check_max_length,
    check_model_path,
    check_packing,
    check_quantized_base,
    check_tied_weights,
    check_vocabulary,
    checkpoint_dropout_exactly,
    disable_dropout,
    load_model,
    load_model_config,
    load_tokenizer,
    model_folder,
)
from finetune.model_files import save_model_files
from finetune.objectives import Balanced, Objective, Preference, Supervised
from finetune.optim import build_optimizer, build_scheduler
from finetune.outputs import check_output_dir, claim_output_dir
from finetune.plan import cheapest_policy, estimate, model_shape, planned_model
from finetune.profile import StepProfiler
from finetune.recompute import Policy
from finetune.reference import (
    REFERENCE_FILE,
    cache_path,
    check_resumable,
    compute_reference,
    read_reference,
    reference_key,
    write_reference,
)
from finetune.routing import check_experts_recipe, route_in_fp32, set_up_routing
from finetune.wrap import format_wrap_plan, fsdp_units, reshard, shard_frozen, validate_wrap_policy

logger = logging.getLogger("finetune")

Batch = dict[str, torch.Tensor]

FINAL_LOGITS = "final_logits.safetensors"


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    num_units: int
    """What the loss is averaged over, in the whole step: target tokens, or pairs (the objective's unit)."""
    model_flops: float
    """Of every process's micro-batches (finetune.flops), for MFU."""
    stop_requested: bool = False
    """Some process was asked to stop (its `stop_flag` was set): every process sees the same."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The objective's metrics, averaged over the step's units."""


@dataclass
class Run:
    """What training works with once everything is built and prepared."""

    recipe: RecipeConfig
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    eval_loader: DataLoader | None
    max_steps: int
    output_dir: Path
    write_model_files: Callable[[Path], None]
    tensor_names: list[list[str]]
    save_state: Callable[[Path], Any]
    """Writes the training state into a checkpoint folder (collective): accelerate's, the adapters' only, or
    DCP's asynchronous save (which returns the futures of its background writes)."""
    loss_path: LossPath
    objective: Objective


@dataclass(frozen=True)
class TrainResult:
    output_dir: Path
    final_checkpoint: Path | None
    """The checkpoint of the last step, to export from; None when a preemption signal stopped training."""


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
    check_packing(recipe.model, recipe.data.packing)
    if recipe.preference is not None and recipe.preference.reference_model:
        check_model_path(recipe.preference.reference_model)
    check_quantized_base(recipe.model, adapters=recipe.peft is not None, export_merged=recipe.output.export_merged)
    quantization = recipe.peft.quantization if recipe.peft is not None and recipe.peft.quantization != "none" else None
    check_experts_recipe(
        load_model_config(recipe.model), quantization, recipe.train.router_aux_loss_coef, _adapts_experts(recipe)
    )
    problems = environment_problems(recipe)
    if problems:
        raise FinetuneError("; ".join(problems))
    if resume_from is not None:
        check_resume_kind(resume_from, adapters=recipe.peft is not None)
        check_resume_objective(resume_from, _objective_name(recipe))
        if recipe.peft is not None:
            from finetune.adapters import check_resume_adapters  # imports peft (2 s): adapter runs only

            check_resume_adapters(resume_from, recipe.peft)
            check_resume_base(resume_from, recipe.model.name_or_path, model_folder(recipe.model.name_or_path))
    return resume_from


def _adapts_experts(recipe: RecipeConfig) -> str | None:
    """The peft key that adapts parameters (fused expert weights) rather than modules, if the recipe sets one."""
    if recipe.peft is not None and recipe.peft.target_experts:
        return "peft.target_experts"
    return "peft.target_parameters" if recipe.peft is not None and recipe.peft.target_parameters else None


def _objective_name(recipe: RecipeConfig) -> str:
    return "supervised" if recipe.preference is None else "preference"


def _base_fingerprint(recipe: RecipeConfig) -> str | None:
    """The `weights_fingerprint` of the recipe's base model, None while a hub model is not cached yet."""
    folder = model_folder(recipe.model.name_or_path)
    return weights_fingerprint(folder) if folder is not None else None


def train(recipe: RecipeConfig, resume_from: Path | None) -> TrainResult:
    """Run the recipe under the accelerate config this process was launched with, from `resume_from`
    (a checkpoint `preflight` chose) or from the start."""
    output_dir = Path(recipe.output.dir)
    accelerator = build_accelerator(
        trackers=recipe.output.trackers,
        project_dir=str(output_dir),
        recipe_activation_checkpointing=recipe.train.checkpointing != "none",
        param_dtype=DTYPES[recipe.model.dtype],
    )
    set_seed(recipe.train.seed)
    policy, policy_line = checkpointing_policy(recipe, accelerator)

    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    check_vocabulary(recipe.model, tokenizer, recipe.preference.reference_model if recipe.preference else None)
    # Under rank-0 loading (cpu_ram_efficient_loading) only rank 0 reads the weights; the others
    # start on the meta device and receive them from rank 0 while the model is sharded.
    started_on_meta = rank_zero_loading() and not accelerator.is_main_process
    quantization = None
    if recipe.peft is not None and recipe.peft.quantization == "nf4":
        from finetune.adapters import quantization_config, storage_dtype

        quantization = quantization_config(storage_dtype(DTYPES[recipe.model.dtype], str(accelerator.mixed_precision)))
    model = load_model(
        recipe.model,
        policy,
        read_weights=not started_on_meta,
        quantization=quantization,
    )
    adapters = None  # for an adapter run, what its export needs to know (adapters.adapter_record)
    if recipe.peft is not None:
        from finetune import adapters as peft_adapters  # imports peft (2 s): adapter runs only

        model = peft_adapters.add_adapters(model, recipe.peft)
        # Checked again now that a hub base is surely in the cache (preflight may have run before it was).
        base = _base_fingerprint(recipe)
        if resume_from is not None:
            check_resume_base(resume_from, recipe.model.name_or_path, model_folder(recipe.model.name_or_path))
        adapters = {**peft_adapters.adapter_record(model), "base": base, "settings": dataclasses.asdict(recipe.peft)}
    names = tensor_names(model)  # before FSDP renames or flattens anything; saved with every checkpoint
    data = build_data(
        recipe.data, tokenizer, accelerator, seed=recipe.train.seed, micro_batch_size=recipe.train.micro_batch_size,
        preference=recipe.preference is not None,
    )  # fmt: skip
    if recipe.preference is not None:
        dropped = disable_dropout(model)  # the policy and its reference must agree at step 1
        if dropped:
            accelerator.print(f"dropout: off for preference tuning ({dropped})")
    fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp_plugin is not None:
        validate_wrap_policy(fsdp_plugin, model)
        replaced = checkpoint_dropout_exactly(fsdp_plugin, model)
        if replaced:
            accelerator.print(replaced)
    broadcast_module_states(accelerator, model)
    optimizer = build_optimizer(model.parameters(), recipe.optim, fused=accelerator.device.type == "cuda")
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, data.train_loader)
    if started_on_meta:
        # accelerate hands the optimizer its sharded parameters by matching storage addresses, which
        # parameters on the meta device do not have (all are 0): rebind them in model order instead.
        optimizer.optimizer.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]
    eval_loader = accelerator.prepare(data.eval_loader) if data.eval_loader is not None else None
    check_tied_weights(accelerator.unwrap_model(model))
    max_steps = _max_steps(recipe, train_loader)
    if resume_from is not None and step_of(resume_from) > max_steps:  # num_epochs runs learn max_steps only here
        raise FinetuneError(
            f"checkpoint {resume_from} is at step {step_of(resume_from)}, past the {max_steps} steps of "
            f"train.num_epochs={recipe.train.num_epochs}; raise train.num_epochs to continue"
        )
    profiled = recipe.train.profile_steps
    if profiled and profiled[0] > max_steps:  # num_epochs runs learn max_steps only here
        raise FinetuneError(
            f"train.profile_steps={profiled} starts after the last step ({max_steps} steps of train.num_epochs="
            f"{recipe.train.num_epochs}), so nothing would be recorded; profile steps within 1..{max_steps}"
        )
    scheduler = build_scheduler(optimizer.optimizer, recipe.optim, max_steps)
    write_model_files = functools.partial(
        save_model_files, accelerator.unwrap_model(model), tokenizer, adapters, model_folder(recipe.model.name_or_path)
    )
    if adapters is not None:
        save_state = functools.partial(peft_adapters.save_adapter_state, accelerator, model, optimizer)
        load_state = functools.partial(peft_adapters.load_adapter_state, accelerator, model, optimizer)
    else:
        save_state, load_state = (lambda folder: accelerator.save_state(str(folder))), accelerator.load_state
    if recipe.checkpoint.async_save:
        save_state = _async_saver(accelerator, model, optimizer, adapters is not None)
    loss_path, loss_line = choose_loss_path(recipe.train.loss, accelerator.unwrap_model(model))
    # Before any forward (a precomputed reference's too): a mixture of experts routes in fp32 from here on.
    compute = compute_dtype(accelerator.mixed_precision, DTYPES[recipe.model.dtype])
    balancing, routing_line = set_up_routing(
        accelerator.unwrap_model(model), recipe.train.router_aux_loss_coef, compute
    )
    objective, write_reference = build_objective(recipe, data, model, accelerator, loss_path, adapters, resume_from)
    if balancing is not None:
        objective = Balanced(objective, balancing)
    run = Run(
        recipe, accelerator, model, optimizer, scheduler, train_loader, eval_loader, max_steps, output_dir,
        write_model_files, names, save_state, loss_path, objective,
    )  # fmt: skip
    start = TrainerState(0, 0, 0, accelerator.num_processes, recipe.model.name_or_path)
    if resume_from is not None:
        # The launch's strategy is known for sure only here (preflight runs outside any launch too).
        check_resume_strategy(resume_from, fsdp=accelerator.distributed_type == DistributedType.FSDP)
        start = load_checkpoint(resume_from, recipe, load_state)
        scheduler.load_state_dict(start.scheduler)
    # Everything is validated, built and restored: only now is the output dir written to.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        claim_output_dir(output_dir, resumed_step=start.step if resume_from else None)
        save_recipe(recipe, output_dir / "recipe.yaml")
        write_reference()
    _check_shared_output_dir(output_dir, accelerator)

    _log_setup(accelerator, recipe, data, model, max_steps, resume_from, [policy_line, loss_line, routing_line])
    metrics = MetricsLogger(accelerator, output_dir, max_steps, recipe.to_dict(), recipe.output.trackers)
    try:
        seen, preempted = run_steps(run, metrics, start)
        if preempted:
            accelerator.print(f"preempted: checkpoint saved at step {preempted}; resume with checkpoint.resume=auto")
            return TrainResult(output_dir, None)
        _write_rank_report(accelerator, model, output_dir, seen, max_steps, started_on_meta)
        if recipe.output.export:
            save_final_logits(run, output_dir / FINAL_LOGITS)
    finally:
        metrics.close()  # ends the progress bar, so that an error message starts on its own line
    final = checkpoints_root(output_dir) / f"step_{max_steps}"
    return TrainResult(output_dir, final if _saves_last_step(recipe) else None)


def build_objective(
    recipe: RecipeConfig,
    data: Data,
    model: torch.nn.Module,
    accelerator: Accelerator,
    loss_path: LossPath,
    adapters: dict[str, Any] | None,
    resume_from: Path | None,
) -> tuple[Objective, Callable[[], None]]:
    """The run's objective, and what writes its files into the output dir once that is claimed (main process).
    A preference run with a precomputed reference computes it here (collective), or reads it: from the
    output dir when resuming, from beside the tokenized data when this base and data computed it before."""
    if recipe.preference is None:
        return Supervised(loss_path), lambda: None
    reference = recipe.preference.resolved_reference(adapters=adapters is not None)
    objective = Preference(recipe.preference, loss_path, reference)
    if reference == "model":
        objective.reference_model = _reference_model(recipe, accelerator)
    if reference != "precomputed":
        return objective, lambda: None
    numerics = f"{loss_path}:{accelerator.mixed_precision}:{recipe.model.dtype}:{recipe.data.packing}"
    key = reference_key(_base_fingerprint(recipe), data.splits, numerics)
    output_file = Path(recipe.output.dir) / REFERENCE_FILE
    cached = cache_path(data.splits[0], key)
    if resume_from is not None:
        table = read_reference(output_file, key)
        folder = model_folder(recipe.model.name_or_path)
        if table is None and folder is not None:  # a run begun by an earlier version keyed it by sampled bytes
            table = read_reference(output_file, reference_key(sampled_fingerprint(folder), data.splits, numerics))
        table = check_resumable(table, Path(recipe.output.dir))
    elif cached is not None and (table := read_reference(cached, key)) is not None:
        accelerator.print(f"reference: log-probabilities of {len(table):,} pairs read from {cached}")
    else:
        micro_batch_size = recipe.train.micro_batch_size
        table = compute_reference(model, data.splits, data.collate, accelerator, micro_batch_size, loss_path)
        if cached is not None and accelerator.is_main_process:
            write_reference(cached, table, key)
    # On the device, where the step looks pairs up by their index without a copy back to the host.
    objective.reference_logps = table.to(accelerator.device)
    return objective, functools.partial(write_reference, output_file, table, key)


def _mesh_shape(model: torch.nn.Module) -> str:
    """' over a 2 x 2 mesh': the device mesh a sharded model's parameters live on, for the log ('' unsharded)."""
    parameter = next(model.parameters())
    if not isinstance(parameter, DTensor):
        return ""
    return " over a " + " x ".join(map(str, parameter.device_mesh.shape)) + " mesh"


def _reference_model(recipe: RecipeConfig, accelerator: Accelerator) -> torch.nn.Module:
    """preference.reference=model: the reference model, frozen, without dropout, in eval mode, in the policy's
    parameter dtype and attention, sharded as the policy is."""
    cfg = dataclasses.replace(recipe.model, name_or_path=recipe.preference.reference_model, config_file=None)
    reference = load_model(cfg, "none")
    reference.requires_grad_(False)
    disable_dropout(reference)
    route_in_fp32(reference)  # as the policy routes (a dense model has no routers)
    reference.eval()
    mesh = getattr(accelerator, "torch_device_mesh", None)  # hybrid sharding's 2-D mesh; None: the whole world
    fsdp_mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None
    shard_frozen(reference, getattr(accelerator.state, "fsdp_plugin", None), accelerator.device, fsdp_mesh)
    accelerator.print(
        f"reference: {cfg.name_or_path}, frozen, sharded as the policy{_mesh_shape(reference)} "
        "(preference.reference=model)"
    )
    return reference


def _async_saver(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, adapters: bool
) -> Callable[[Path], list[Future]]:
    """checkpoint.async_save: DCP's asynchronous save of accelerate's SHARDED layout, over gloo groups of its
    own (created here, on every rank): its background threads never share a group with training or each other."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    sharded = plugin is not None and plugin.fsdp_version == 2 and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    if not sharded or adapters:
        raise FinetuneError(
            "checkpoint.async_save needs full fine-tuning under FSDP2 with fsdp_state_dict_type: SHARDED_STATE_DICT "
            "(e.g. accelerate_configs/fsdp2_full_shard.yaml); set checkpoint.async_save=false for this launch"
        )
    groups = (torch.distributed.new_group(backend="gloo"), torch.distributed.new_group(backend="gloo"))
    return functools.partial(async_save_state, accelerator, model, optimizer, groups)


def run_steps(run: Run, metrics: MetricsLogger, start: TrainerState) -> tuple[str, int]:
    """Train from `start` to `run.max_steps`, logging, evaluating and checkpointing on schedule.

    Returns a fingerprint of the data this rank saw, and the step at which a preemption signal
    stopped training after saving a checkpoint (0 when training ran to the end).
    """
    recipe, accelerator = run.recipe, run.accelerator
    accumulation = recipe.train.gradient_accumulation_steps
    save_every = recipe.checkpoint.save_every_steps
    save_last = _saves_last_step(recipe)
    rows_per_micro_batch = recipe.train.micro_batch_size * accelerator.num_processes
    # A fingerprint of the token ids this rank trained on, accumulated on the device without syncing.
    data_fingerprint = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    last_log_time, tokens_since_log, steps_since_log, flops_since_log = time.perf_counter(), 0, 0, 0.0
    flops = model_flops(accelerator.unwrap_model(run.model))
    peak = peak_flops(accelerator.device)
    windows = _accumulation_windows(run.train_loader, accumulation, start, rows_per_micro_batch, accelerator)
    probe: MemoryProbe | None = MemoryProbe(run.model, accelerator)  # measures this run's first step
    pending: PendingCheckpoint | None = None  # an asynchronous save still writing
    profiler = StepProfiler(recipe.train.profile_steps, run.max_steps, run.output_dir / "profile",
                            accelerator.process_index, accelerator.device)  # fmt: skip
    metrics.advance(start.step)
    with PreemptionSignals(enabled=save_every > 0) as preemption:
        for step in range(start.step + 1, run.max_steps + 1):
            profiler.begin(step)  # data loading, the step and its logging; evaluation and saves are not
            epoch, rows_into_epoch, micro_batches = next(windows)
            for i, batch in enumerate(micro_batches):
                data_fingerprint += batch["input_ids"].long().sum() * (step * accumulation + i)
            lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses
            result = train_step(
                run.model, run.optimizer, micro_batches, accelerator, recipe.optim.max_grad_norm, step, probe,
                loss_path=run.loss_path, flops=flops, stop_flag=preemption.flag, objective=run.objective,
            )  # fmt: skip
            run.scheduler.step()
            if probe is not None:
                reports = gather_reports(accelerator, probe.report)
                accelerator.print(format_reports(reports))
                metrics.log(step, memory_metrics(reports))
                probe = None
            tokens_since_log += result.num_tokens
            flops_since_log += result.model_flops
            steps_since_log += 1
            metrics.advance()
            last_step = step == run.max_steps
            if step % recipe.train.log_every_steps == 0 or last_step:
                elapsed = max(time.perf_counter() - last_log_time, 1e-9)
                values = {
                    "loss": result.loss,
                    "lr": lr,
                    "grad_norm": result.grad_norm,
                    "tokens_per_second": tokens_since_log / elapsed,
                    "step_seconds": elapsed / steps_since_log,
                    run.objective.unit_name: result.num_units,
                    **result.metrics,
                }
                if peak is not None:
                    values["mfu"] = flops_since_log / elapsed / (peak * accelerator.num_processes)
                metrics.log(step, values | run.objective.periodic_metrics(accelerator))
                last_log_time, tokens_since_log, steps_since_log, flops_since_log = time.perf_counter(), 0, 0, 0.0
            if (profiled := profiler.end(step)) is not None:
                accelerator.print(profiled)
            eval_due = recipe.train.eval_every_steps and step % recipe.train.eval_every_steps == 0
            if run.eval_loader is not None and (eval_due or last_step):
                evaluated = run.objective.evaluate(run.model, run.eval_loader, accelerator)
                metrics.log(step, {f"eval_{name}": value for name, value in evaluated.items()})
            stop = result.stop_requested  # a signal during this step's update or evaluation stops at the next
            if (save_every and (step % save_every == 0 or stop)) or (save_last and last_step):
                state = TrainerState(
                    step,
                    epoch,
                    rows_into_epoch,
                    accelerator.num_processes,
                    recipe.model.name_or_path,
                    run.scheduler.state_dict(),
                    _objective_name(recipe),
                )
                began = time.perf_counter()
                if pending is not None:  # the previous asynchronous save: its writes end before the next starts
                    finish_checkpoint(accelerator, pending)
                pending = save_checkpoint(
                    accelerator, run.output_dir, state, recipe, run.write_model_files, run.tensor_names, run.save_state
                )
                if not recipe.checkpoint.async_save:
                    finish_checkpoint(accelerator, pending)
                    pending = None
                # How long training stood still for this save; kept out of the next logged step time.
                saving = time.perf_counter() - began
                metrics.log(step, {"checkpoint_seconds": saving})
                last_log_time += saving
            if stop and not last_step:
                if pending is not None:
                    finish_checkpoint(accelerator, pending)
                if (profiled := profiler.end(step, stopping=True)) is not None:
                    accelerator.print(profiled)
                return f"{data_fingerprint.item():x}", step
    if pending is not None:  # the last save completes before export reads it
        finish_checkpoint(accelerator, pending)
    return f"{data_fingerprint.item():x}", 0


@torch.no_grad()
def save_final_logits(run: Run, path: Path) -> None:
    """Logits of the trained model on a fixed token sequence (collective forward; the main process
    writes them): any reload of the exported model must reproduce them."""
    vocab_size = run.accelerator.unwrap_model(run.model).config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    run.model.eval()
    logits = run.model(input_ids=input_ids.to(run.accelerator.device), use_cache=False).logits
    reshard(run.model)
    run.model.train()
    if run.accelerator.is_main_process:
        save_file({"input_ids": input_ids, "logits": logits.float().cpu().contiguous()}, path)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Batch],
    accelerator: Accelerator,
    max_grad_norm: float,
    step: int,
    probe: MemoryProbe | None = None,
    *,
    loss_path: LossPath,
    flops: ModelFlops | None = None,
    stop_flag: float = 0.0,
    objective: Objective | None = None,
) -> StepResult:
    """One optimizer step over this process's micro-batches; returns the global loss per unit of the objective
    (target token, or pair), its metrics, and whether any process set `stop_flag` (reduced with the loss: no
    collective of its own)."""
    objective = objective if objective is not None else Supervised(loss_path)
    device = accelerator.device
    counts = [
        sum(objective.count(b) for b in micro_batches),
        sum(b["num_tokens"] for b in micro_batches),
        sum(b["input_ids"].numel() for b in micro_batches),  # token slots, padding included: the rows' fill
        sum(flops.batch(b, b["num_tokens"]) for b in micro_batches) if flops is not None else 0,
    ]
    # Every process needs the global unit count before its first backward: it is all-reduced and used on the
    # device, so the host goes on queueing the forwards. float64 holds the counts exactly (below 2**53).
    counts = accelerator.reduce(torch.stack([_on_device(c, device) for c in counts]), "sum")
    # DDP and FSDP average gradients over processes; multiplying by the process count turns that
    # average into a sum, so the update is the gradient of (all unit losses) / (all units of the step).
    # fp32, as a Python number multiplying the fp32 loss would be.
    scale = (accelerator.num_processes / counts[0].clamp(min=1)).float()
    loss_sum = torch.zeros((), device=device)
    metric_sums = torch.zeros(len(objective.metric_names), device=device)
    for i, batch in enumerate(micro_batches):
        # DDP can skip the gradient all-reduce until the last micro-batch. FSDP reduce-scatters every
        # micro-batch instead: skipping would keep unsharded gradients and defeat its memory savings.
        skip_sync = i < len(micro_batches) - 1 and accelerator.distributed_type != DistributedType.FSDP
        with accelerator.no_sync(model) if skip_sync else nullcontext():
            with probe.counting_activations() if probe is not None and i == 0 else nullcontext():
                summed, sums = objective.loss(model, batch)
            accelerator.backward(summed * scale)
        loss_sum += summed.detach()
        metric_sums += sums.to(device)
    flag = torch.full((), stop_flag, device=device)
    reduced = accelerator.reduce(torch.cat([torch.stack([loss_sum, flag]), metric_sums]), "sum")
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    # The step's one host sync, after the last backward: the divergence guard needs the loss and the gradient
    # norm before the update. Under CPU offload the gradients, and so their norm, are in host memory.
    on_host = torch.cat([counts, reduced.double(), grad_norm.reshape(1).to(device, torch.float64)]).tolist()
    num_units, num_tokens, num_slots, step_flops, summed_loss, stops, *summed_metrics, grad_norm = on_host
    loss = summed_loss / max(num_units, 1)
    step_metrics = {
        name: value / max(num_units, 1) for name, value in zip(objective.metric_names, summed_metrics, strict=True)
    }
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise FinetuneError(
            f"step {step}: loss is {loss} and gradient norm is {grad_norm}; training diverged before this update was "
            "applied. Lower optim.lr, raise optim.warmup_steps, or keep model.dtype float32 with bf16 mixed precision"
        )
    optimizer.step()
    if probe is not None:
        probe.measure_update(optimizer)
    optimizer.zero_grad(set_to_none=True)
    step_metrics["fill"] = num_tokens / max(num_slots, 1)
    return StepResult(loss, grad_norm, int(num_tokens), int(num_units), step_flops, stops > 0, step_metrics)


def _on_device(count: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A count as a float64 on the device: a tensor converted there, a number written there (no copy from host
    memory, which a GPU would wait for)."""
    if isinstance(count, torch.Tensor):
        return count.to(device, torch.float64, non_blocking=True)
    return torch.full((), count, dtype=torch.float64, device=device)


def _accumulation_windows(
    loader: DataLoader, accumulation: int, start: TrainerState, rows_per_micro_batch: int, accelerator: Accelerator
) -> Iterator[tuple[int, int, list[Batch]]]:
    """(epoch, rows of the epoch consumed after this window, micro-batches) for each optimizer step.

    Every epoch is one seeded permutation of the rows, the same on any process count; a resumed
    run skips exactly the rows its checkpoint had consumed in that epoch.
    """
    if start.rows_into_epoch % rows_per_micro_batch:
        raise FinetuneError(
            f"the checkpoint stopped {start.rows_into_epoch} rows into epoch {start.epoch}, not a whole number of "
            f"micro-batches of micro_batch_size x processes = {rows_per_micro_batch} rows; resume with a "
            "micro_batch_size and process count whose product divides it"
        )
    for epoch in itertools.count(start.epoch):
        loader.set_epoch(epoch)
        skipped = start.rows_into_epoch // rows_per_micro_batch if epoch == start.epoch else 0
        batches = iter(accelerator.skip_first_batches(loader, skipped) if skipped else loader)
        consumed = skipped
        while len(window := list(itertools.islice(batches, accumulation))) == accumulation:
            consumed += accumulation
            yield epoch, consumed * rows_per_micro_batch, window


def _saves_last_step(recipe: RecipeConfig) -> bool:
    """The last step is checkpointed when checkpointing is on, and always for the export, which reads it."""
    return bool(recipe.checkpoint.save_every_steps or recipe.output.export)


def _max_steps(recipe: RecipeConfig, train_loader: DataLoader) -> int:
    steps_per_epoch = len(train_loader) // recipe.train.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise FinetuneError(
            f"one epoch gives each process {len(train_loader)} micro-batches, fewer than "
            f"train.gradient_accumulation_steps={recipe.train.gradient_accumulation_steps}; add data or lower it"
        )
    if recipe.train.max_steps is not None:
        return recipe.train.max_steps
    return max(1, math.ceil(recipe.train.num_epochs * steps_per_epoch))


def _check_shared_output_dir(output_dir: Path, accelerator: Accelerator) -> None:
    """Every rank must see the same output dir: a checkpoint is written by all ranks together, and a
    machine writing its shards to a local disk would leave checkpoints that no one can resume or export."""
    marker = output_dir / ".shared-check"
    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    if accelerator.is_main_process:
        marker.write_text(token[0])
    broadcast_object_list(token)  # also the barrier after rank 0 wrote the marker
    sees = marker.is_file() and marker.read_text() == token[0]
    blind = accelerator.gather(torch.tensor([0 if sees else 1], device=accelerator.device))
    if accelerator.is_main_process:
        marker.unlink()
    if blind.any():
        ranks = ", ".join(str(rank) for rank in blind.nonzero().flatten().tolist())
        raise FinetuneError(
            f"output.dir {output_dir} is not the same folder on every machine: rank(s) {ranks} cannot see what rank 0 "
            "wrote there. Put output.dir on a filesystem that all machines share (NFS, Lustre, ...), so that every "
            "checkpoint holds the shards of all ranks"
        )


_RECOMPUTED = {
    "none": "every activation kept, nothing recomputed",
    "full": "each decoder layer keeps its input and recomputes its forward in backward",
    "selective": "decoder layers keep matmul and attention outputs and recompute the rest",
}


def checkpointing_policy(recipe: RecipeConfig, accelerator: Accelerator) -> tuple[Policy, str | None]:
    """The recipe's activation-checkpointing policy, `auto` resolved by the plan's estimate against this
    device's memory (`finetune.plan.cheapest_policy`), and its log line (None for none, asked for)."""
    requested = recipe.train.checkpointing
    if requested != "auto":
        return (
            requested,
            f"activation checkpointing: {requested} ({_RECOMPUTED[requested]})" if requested != "none" else None,
        )
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


def _attention_line(accelerator: Accelerator, recipe: RecipeConfig, model: torch.nn.Module) -> str:
    implementation = accelerator.unwrap_model(model).config._attn_implementation
    if implementation != attention.NAME:
        packed = " (packed rows: block-causal mask; model.attn_implementation=varlen passes boundaries)"
        return f"attention: {implementation}" + (packed if recipe.data.packing and implementation == "sdpa" else "")
    kernel = attention.kernel(
        accelerator.device, compute_dtype(accelerator.mixed_precision, DTYPES[recipe.model.dtype])
    )
    return f"attention: varlen, packed rows by their sample boundaries ({kernel})"


def _log_setup(
    accelerator: Accelerator,
    recipe: RecipeConfig,
    data: Data,
    model: torch.nn.Module,
    max_steps: int,
    resume_from: Path | None,
    choices: list[str | None],
) -> None:
    """The run's setup in the log; `choices`: lines of what the run chose (checkpointing, loss path), if any."""
    if not accelerator.is_main_process:
        return
    processes = accelerator.num_processes
    global_batch = recipe.train.micro_batch_size * recipe.train.gradient_accumulation_steps * processes
    if recipe.peft is not None:
        from finetune.adapters import adapter_precision

        precision = adapter_precision(model, accelerator.mixed_precision)
    else:
        precision = precision_policy(accelerator, DTYPES[recipe.model.dtype], next(model.parameters()).dtype)
    lines = [
        f"strategy: {strategy_name(accelerator)} on {accelerator.device.type}",
        precision,
        _attention_line(accelerator, recipe, model),
        *(line for line in choices if line is not None),
        f"batch: {recipe.train.micro_batch_size} x {recipe.train.gradient_accumulation_steps} accumulation x "
        f"{processes} processes = {global_batch} {'pairs' if recipe.preference else 'sequences'} per step, "
        f"{max_steps} steps",
        data.train_stats.describe("train data"),
    ]
    compiled = sum(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        regional = accelerator.state.dynamo_plugin.use_regional_compilation
        lines.append(
            f"compile: {accelerator.state.dynamo_plugin.backend.value.lower()}, "
            + (f"regional ({compiled} modules compiled in place)" if regional else "the whole model")
        )
    if recipe.peft is not None:
        from finetune.adapters import describe_adapters

        lines.insert(2, describe_adapters(model))
    if data.eval_stats is not None:
        lines.append(data.eval_stats.describe("eval data"))
    if accelerator.distributed_type == DistributedType.FSDP:
        lines.append(format_wrap_plan(fsdp_units(model)))
    if resume_from is not None:
        changes = recipe_changes(resume_from, recipe)
        changed = f", with settings changed since it was saved: {'; '.join(changes)}" if changes else ""
        lines.append(f"resumed from {resume_from}{changed}")
    for line in lines:
        accelerator.print(line)


def _write_rank_report(
    accelerator: Accelerator,
    model: torch.nn.Module,
    output_dir: Path,
    data_fingerprint: str,
    max_steps: int,
    started_on_meta: bool,
) -> None:
    """Per-rank facts for debugging a distributed run: what this rank holds and what data it saw."""
    report = shard_report(accelerator, model)
    report.update(
        steps=max_steps,
        data_fingerprint=data_fingerprint,
        params_fingerprint=local_params_fingerprint(model),
        started_on_meta_device=started_on_meta,
    )
    ranks_dir = output_dir / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    (ranks_dir / f"rank_{accelerator.process_index}.json").write_text(json.dumps(report, indent=2))
