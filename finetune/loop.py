"""The training loop: recipe -> accelerator -> model and data -> steps -> export.

Loss normalization: each optimizer step minimizes (sum of token losses) / (target tokens in the
whole step, over all micro-batches and all processes). That is the same objective whether the
global batch is split 4x1x1 or 1x2x2 (micro-batch x accumulation x processes); a mean of
per-micro-batch means would weight short and long batches differently.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from finetune.config import RecipeConfig, save_recipe
from finetune.data import IGNORE, Data, build_data
from finetune.distributed import (
    broadcast_module_states,
    build_accelerator,
    local_params_fingerprint,
    shard_report,
    strategy_name,
)
from finetune.errors import FinetuneError
from finetune.evaluate import evaluate, token_losses
from finetune.export import export_model
from finetune.metrics import MetricsLogger
from finetune.model import DTYPES, load_model, load_tokenizer
from finetune.optim import build_optimizer, build_scheduler
from finetune.wrap import format_wrap_plan, fsdp_units, validate_wrap_policy

logger = logging.getLogger("finetune")

Batch = dict[str, torch.Tensor]


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    num_target_tokens: int


def train(recipe: RecipeConfig) -> Path:
    """Run the recipe under the accelerate config this process was launched with; return the output dir."""
    output_dir = Path(recipe.output.dir)
    _check_output_dir(output_dir, recipe.output.overwrite)
    accelerator = build_accelerator(
        trackers=recipe.output.trackers,
        project_dir=str(output_dir),
        recipe_activation_checkpointing=recipe.train.activation_checkpointing,
    )
    set_seed(recipe.train.seed)

    tokenizer = load_tokenizer(recipe.model)
    model = load_model(recipe.model, recipe.train.activation_checkpointing)
    data = build_data(
        recipe.data, tokenizer, accelerator, seed=recipe.train.seed, micro_batch_size=recipe.train.micro_batch_size
    )
    fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp_plugin is not None:
        validate_wrap_policy(fsdp_plugin, model)
    broadcast_module_states(accelerator, model)
    optimizer = build_optimizer(model.parameters(), recipe.optim)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, data.train_loader)
    eval_loader = accelerator.prepare(data.eval_loader) if data.eval_loader is not None else None
    max_steps = _max_steps(recipe, train_loader)
    scheduler = build_scheduler(optimizer.optimizer, recipe.optim, max_steps)
    # Everything is validated and built: only now is the output dir written to.
    _claim_output_dir(output_dir, accelerator)
    if accelerator.is_main_process:
        save_recipe(recipe, output_dir / "recipe.yaml")

    _log_setup(accelerator, recipe, data, model, max_steps)
    metrics = MetricsLogger(accelerator, output_dir, max_steps, recipe.to_dict(), recipe.output.trackers)
    try:
        seen = run_steps(recipe, accelerator, model, optimizer, scheduler, train_loader, eval_loader, metrics)
        if recipe.output.export:
            export_dtype = DTYPES[recipe.output.export_dtype or recipe.model.dtype]
            export_model(accelerator, model, tokenizer, output_dir / "final", export_dtype)
        _write_rank_report(accelerator, model, output_dir, seen, max_steps)
    finally:
        metrics.close()  # ends the progress bar, so that an error message starts on its own line
    return output_dir


def run_steps(
    recipe: RecipeConfig,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    train_loader: DataLoader,
    eval_loader: DataLoader | None,
    metrics: MetricsLogger,
) -> str:
    """Train `metrics.max_steps` steps, logging and evaluating on schedule; return a fingerprint of the data seen."""
    # A fingerprint of the token ids this rank trained on, accumulated on the device without syncing.
    data_fingerprint = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    last_log_time, tokens_since_log = time.perf_counter(), 0
    batches = _accumulation_windows(train_loader, recipe.train.gradient_accumulation_steps)
    for step in range(1, metrics.max_steps + 1):
        micro_batches = next(batches)
        for i, batch in enumerate(micro_batches):
            data_fingerprint += batch["input_ids"].long().sum() * (step * len(micro_batches) + i)
        lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
        result = train_step(model, optimizer, micro_batches, accelerator, recipe.optim.max_grad_norm, step)
        scheduler.step()
        tokens_since_log += result.num_tokens
        metrics.advance()
        last_step = step == metrics.max_steps
        if step % recipe.train.log_every_steps == 0 or last_step:
            elapsed = time.perf_counter() - last_log_time
            metrics.log(
                step,
                {
                    "loss": result.loss,
                    "lr": lr,
                    "grad_norm": result.grad_norm,
                    "tokens_per_second": tokens_since_log / max(elapsed, 1e-9),
                    "target_tokens": result.num_target_tokens,
                },
            )
            last_log_time, tokens_since_log = time.perf_counter(), 0
        eval_due = recipe.train.eval_every_steps and step % recipe.train.eval_every_steps == 0
        if eval_loader is not None and (eval_due or last_step):
            metrics.log(step, {"eval_loss": evaluate(model, eval_loader, accelerator)})
    return f"{data_fingerprint.item():x}"


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Batch],
    accelerator: Accelerator,
    max_grad_norm: float,
    step: int,
) -> StepResult:
    """One optimizer step over this process's micro-batches; returns the global loss per target token."""
    counts = torch.stack(
        [sum((b["target_ids"] != IGNORE).sum() for b in micro_batches), sum(b["num_tokens"] for b in micro_batches)]
    )
    # One all-reduce, one device sync: every process needs the global target count before its first backward.
    num_targets, num_tokens = accelerator.reduce(counts, "sum").tolist()
    # DDP and FSDP average gradients over processes; multiplying by the process count turns that
    # average into a sum, so the update is the gradient of (all token losses) / (all target tokens).
    scale = accelerator.num_processes / max(num_targets, 1)
    loss_sum = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(micro_batches):
        # DDP can skip the gradient all-reduce until the last micro-batch. FSDP reduce-scatters every
        # micro-batch instead: skipping would keep unsharded gradients and defeat its memory savings.
        skip_sync = i < len(micro_batches) - 1 and accelerator.distributed_type != DistributedType.FSDP
        with accelerator.no_sync(model) if skip_sync else nullcontext():
            batch_loss = token_losses(model, batch).sum()
            accelerator.backward(batch_loss * scale)
        loss_sum += batch_loss.detach()
    loss = accelerator.reduce(loss_sum, "sum").item() / max(num_targets, 1)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise FinetuneError(
            f"step {step}: loss is {loss} and gradient norm is {grad_norm}; training diverged before this update was "
            "applied. Lower optim.lr, raise optim.warmup_steps, or keep model.dtype float32 with bf16 mixed precision"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, int(num_tokens), int(num_targets))


def _accumulation_windows(loader: DataLoader, accumulation_steps: int) -> Iterator[list[Batch]]:
    """Groups of micro-batches, one group per optimizer step, epoch after epoch (reshuffled by epoch)."""
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        batches = iter(loader)
        while len(window := list(itertools.islice(batches, accumulation_steps))) == accumulation_steps:
            yield window


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


def _check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a non-empty output dir unless overwrite is set, so earlier results are never lost."""
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FinetuneError(
            f"output dir {output_dir} is not empty; choose another output.dir or pass output.overwrite=true "
            "to replace its contents"
        )


def _claim_output_dir(output_dir: Path, accelerator: Accelerator) -> None:
    """Create the output dir and clear what an earlier run left that this one would mix with its own."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(output_dir / "ranks", ignore_errors=True)
    accelerator.wait_for_everyone()


def _log_setup(accelerator: Accelerator, recipe: RecipeConfig, data: Data, model: torch.nn.Module, max_steps: int):
    if not accelerator.is_main_process:
        return
    processes = accelerator.num_processes
    global_batch = recipe.train.micro_batch_size * recipe.train.gradient_accumulation_steps * processes
    precision = accelerator.mixed_precision
    lines = [
        f"strategy: {strategy_name(accelerator)} on {accelerator.device.type}",
        f"precision: parameters and optimizer state in {recipe.model.dtype}, compute in "
        f"{'bf16' if precision == 'bf16' else 'fp16' if precision == 'fp16' else recipe.model.dtype}",
        f"batch: {recipe.train.micro_batch_size} x {recipe.train.gradient_accumulation_steps} accumulation x "
        f"{processes} processes = {global_batch} sequences per step, {max_steps} steps",
        data.train_stats.describe("train data"),
    ]
    if data.eval_stats is not None:
        lines.append(data.eval_stats.describe("eval data"))
    if accelerator.distributed_type == DistributedType.FSDP:
        lines.append(format_wrap_plan(fsdp_units(model)))
    elif getattr(accelerator.state, "fsdp_plugin", None) is not None:
        lines.append("the accelerate config asks for FSDP, but one process has nothing to shard: training unsharded")
    for line in lines:
        accelerator.print(line)


def _write_rank_report(
    accelerator: Accelerator, model: torch.nn.Module, output_dir: Path, data_fingerprint: str, max_steps: int
) -> None:
    """Per-rank facts for debugging a distributed run: what this rank holds and what data it saw."""
    report = shard_report(accelerator, model)
    report.update(
        steps=max_steps, data_fingerprint=data_fingerprint, params_fingerprint=local_params_fingerprint(model)
    )
    ranks_dir = output_dir / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    (ranks_dir / f"rank_{accelerator.process_index}.json").write_text(json.dumps(report, indent=2))
