"""The training loop: steps over the built run (`finetune.run.build`), logging, evaluating and saving on schedule.

Loss normalization: each optimizer step minimizes (sum of token losses) / (target tokens in the
whole step, over all micro-batches and all processes). That is the same objective whether the
global batch is split 4x1x1 or 1x2x2 (micro-batch x accumulation x processes); a mean of
per-micro-batch means would weight short and long batches differently.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from finetune.config import RecipeConfig
from finetune.engine.batch import Batch
from finetune.engine.memory import MemoryProbe, format_reports, gather_reports, memory_metrics
from finetune.engine.processes import PreemptionSignals
from finetune.engine.sequence import data_parallel_size
from finetune.errors import FinetuneError
from finetune.objectives import Objective, Supervised
from finetune.objectives.loss import LossPath
from finetune.objectives.metrics import unit_means
from finetune.plan.flops import ModelFlops, model_flops, peak_flops
from finetune.run.build import Run
from finetune.run.metrics import MetricsLogger
from finetune.run.profile import StepProfiler
from finetune.storage.checkpoint import PendingCheckpoint, TrainingState, finish_checkpoint, save_checkpoint


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    num_units: int
    """What the loss is averaged over, in the whole step: target tokens, or pairs (the objective's unit)."""
    model_flops: float
    """Of every process's micro-batches (finetune.plan.flops), for MFU."""
    stop_requested: bool = False
    """Some process was asked to stop (its `stop_flag` was set): every process sees the same."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The objective's metrics, averaged over the step's units."""


def run_steps(run: Run, metrics: MetricsLogger) -> tuple[str, int]:
    """Train from `run.start` to `run.max_steps`, logging, evaluating and checkpointing on schedule.

    Returns a fingerprint of the data this rank saw, and the step at which a preemption signal
    stopped training after saving a checkpoint (0 when training ran to the end).
    """
    recipe, accelerator = run.recipe, run.accelerator
    accumulation = run.accumulation
    rows_per_micro_batch = recipe.train.micro_batch_size * data_parallel_size(accelerator)
    window = _LogWindow(model_flops(accelerator.unwrap_model(run.model)), peak_flops(accelerator.device))
    windows = _accumulation_windows(run.train_loader, accumulation, run.start, rows_per_micro_batch, accelerator)
    draws = _Draws(windows, accumulation, torch.zeros((), dtype=torch.int64, device=accelerator.device))
    probe: MemoryProbe | None = MemoryProbe(run.model, accelerator)  # measures this run's first step
    saver = _Saver(run, metrics, window)
    profiler = StepProfiler(recipe.train.profile_steps, run.max_steps, run.output_dir / "profile",
                            accelerator.process_index, accelerator.device)  # fmt: skip
    metrics.advance(run.start.step)
    # Online RL trains each window (a rollout) for several steps; checkpoints fall between windows.
    reuse = run.objective.steps_per_window
    stopping = False
    with PreemptionSignals(enabled=recipe.checkpoint.save_every_steps > 0) as preemption:
        for step in range(run.start.step + 1, run.max_steps + 1):
            profiler.begin(step)  # data loading, the step and its logging; evaluation and saves are not
            if (step - 1) % reuse == 0:
                loaded = draws.first(step)
            micro_batches = run.objective.rollout(run.model, loaded, step, accelerator, draws.next)
            lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses
            result = train_step(
                run.model, run.optimizer, micro_batches, accelerator, recipe.optim.max_grad_norm, step, probe,
                loss_path=run.loss_path, flops=window.flops, stop_flag=preemption.flag, objective=run.objective,
            )  # fmt: skip
            run.scheduler.step()
            if probe is not None:
                reports = gather_reports(accelerator, probe.report)
                accelerator.print(format_reports(reports))
                metrics.log(step, memory_metrics(reports))
                probe = None
            window.add(result)
            metrics.advance()
            last_step = step == run.max_steps
            if step % recipe.train.log_every_steps == 0 or last_step:
                metrics.log(step, window.values(run, result, lr) | run.objective.periodic_metrics(accelerator))
            if (profiled := profiler.end(step)) is not None:
                accelerator.print(profiled)
            _evaluate_if_due(run, metrics, step)
            # A signal during this step's update or evaluation stops at the end of its window.
            stopping = stopping or result.stop_requested
            stop = stopping and step % reuse == 0
            saver.save_if_due(step, draws.epoch, draws.rows_into_epoch, stop)
            if stop and not last_step:
                saver.finish()
                if (profiled := profiler.end(step, stopping=True)) is not None:
                    accelerator.print(profiled)
                return f"{draws.fingerprint.item():x}", step
    saver.finish()  # the last save completes before export reads it
    return f"{draws.fingerprint.item():x}", 0


@dataclass
class _Draws:
    """The loader's windows as the loop draws them, and where the data stands after the last one (a checkpoint's
    place in it): a window a step, and more where a rollout draws them (online RL's dynamic sampling)."""

    windows: Iterator[tuple[int, int, list[Batch]]]
    accumulation: int
    fingerprint: torch.Tensor
    """The token ids this rank trained on, weighted by their place, accumulated on the device without syncing."""
    epoch: int = 0
    rows_into_epoch: int = 0
    step: int = 0
    drawn: int = 0
    """Micro-batches drawn since the step began."""

    def first(self, step: int) -> list[Batch]:
        self.step, self.drawn = step, 0
        return self.next()

    def next(self) -> list[Batch]:
        self.epoch, self.rows_into_epoch, window = next(self.windows)
        for i, batch in enumerate(window):
            self.fingerprint += batch["input_ids"].long().sum() * (self.step * self.accumulation + self.drawn + i)
        self.drawn += len(window)
        return window


@dataclass
class _LogWindow:
    """What happened since the last logged step: its tokens, steps and model FLOPs, from when it began."""

    flops: ModelFlops | None
    peak: float | None
    began: float = dataclasses.field(default_factory=time.perf_counter)
    tokens: int = 0
    steps: int = 0
    model_flops: float = 0.0

    def add(self, result: StepResult) -> None:
        self.tokens += result.num_tokens
        self.model_flops += result.model_flops
        self.steps += 1

    def values(self, run: Run, result: StepResult, lr: float) -> dict[str, float]:
        """The logged step's metrics, over the window, which then starts again."""
        elapsed = max(time.perf_counter() - self.began, 1e-9)
        values = {
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_per_second": self.tokens / elapsed,
            "step_seconds": elapsed / self.steps,
            run.objective.unit_name: result.num_units,
            **result.metrics,
        }
        if self.peak is not None:
            values["mfu"] = self.model_flops / elapsed / (self.peak * run.accelerator.num_processes)
        self.began, self.tokens, self.steps, self.model_flops = time.perf_counter(), 0, 0, 0.0
        return values


def _evaluate_if_due(run: Run, metrics: MetricsLogger, step: int) -> None:
    every = run.recipe.train.eval_every_steps
    if run.eval_loader is not None and ((every and step % every == 0) or step == run.max_steps):
        evaluated = run.objective.evaluate(run.model, run.eval_loader, run.accelerator)
        if run.generation is not None:
            generated = run.generation.evaluate(run.model, run.accelerator)
            metrics.say(run.generation.describe(step, generated))
            evaluated |= generated
        metrics.log(step, {f"eval_{name}": value for name, value in evaluated.items()})


class _Saver:
    """Checkpoints on schedule (every `save_every_steps`, at a stop signal, and the last step when the run saves
    it), at most one asynchronous save writing at a time."""

    def __init__(self, run: Run, metrics: MetricsLogger, window: _LogWindow):
        self.run, self.metrics, self.window = run, metrics, window
        self.pending: PendingCheckpoint | None = None  # an asynchronous save still writing

    def save_if_due(self, step: int, epoch: int, rows_into_epoch: int, stop: bool) -> None:
        run, recipe, accelerator = self.run, self.run.recipe, self.run.accelerator
        save_every = recipe.checkpoint.save_every_steps
        scheduled = save_every and (step % save_every == 0 or stop)
        if not (scheduled or (saves_last_step(recipe) and step == run.max_steps)):
            return
        state = TrainingState(
            step, epoch, rows_into_epoch, accelerator.num_processes, recipe.model.name_or_path,
            run.scheduler.state_dict(), run.objective_name,
        )  # fmt: skip
        began = time.perf_counter()
        self.finish()  # the previous asynchronous save: its writes end before the next starts
        self.pending = save_checkpoint(
            accelerator, run.output_dir, state, recipe, run.write_model_files, run.tensor_names, run.save_state
        )
        if not recipe.checkpoint.async_save:
            self.finish()
        # How long training stood still for this save; kept out of the next logged step time.
        saving = time.perf_counter() - began
        self.metrics.log(step, {"checkpoint_seconds": saving})
        self.window.began += saving

    def finish(self) -> None:
        if self.pending is not None:
            finish_checkpoint(self.run.accelerator, self.pending)
            self.pending = None


def saves_last_step(recipe: RecipeConfig) -> bool:
    """The last step is checkpointed when checkpointing is on, and always for the export, which reads it."""
    return bool(recipe.checkpoint.save_every_steps or recipe.output.export)


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
    sums = dict(zip(objective.metric_names, summed_metrics, strict=True))
    step_metrics = unit_means(sums, num_units, getattr(objective, "metric_units", {}))  # your own may have none
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
    loader: DataLoader, accumulation: int, start: TrainingState, rows_per_micro_batch: int, accelerator: Accelerator
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
