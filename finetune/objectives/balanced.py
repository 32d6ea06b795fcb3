"""An objective with a mixture of experts' load-balancing term added (finetune.model.routing).

The term of a micro-batch is weighted by the units the objective averages over, like its loss, so the loop's
normalization (sum over the step's micro-batches and processes, divided by the step's units) gives
mean loss + coefficient x the unit-weighted mean balancing term. `aux_loss` is logged apart (before the
coefficient); the logged loss is what the step minimizes, the balancing term included, as transformers' MoE
models report it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.engine.batch import Batch
from finetune.model.routing import BalancingLoss

if TYPE_CHECKING:
    from finetune.objectives import Objective


@dataclass(frozen=True)
class WithBalancingLoss:
    inner: Objective
    """The objective the balancing loss is added to."""
    balancing: BalancingLoss

    @property
    def unit_name(self) -> str:
        return self.inner.unit_name

    @property
    def metric_names(self) -> tuple[str, ...]:
        return (*self.inner.metric_names, "aux_loss")

    @property
    def metric_units(self) -> dict[str, str]:
        return getattr(self.inner, "metric_units", {})

    @property
    def progress_name(self) -> str | None:
        return self.inner.progress_name

    @property
    def steps_per_window(self) -> int:
        return self.inner.steps_per_window

    def rollout(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        step: int,
        accelerator: Accelerator,
        draw: Callable[[], list[Batch]] | None = None,
    ) -> list[Batch]:
        return self.inner.rollout(model, micro_batches, step, accelerator, draw)

    def count(self, batch: Batch) -> torch.Tensor:
        return self.inner.count(batch)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.balancing.recording():
            summed, sums = self.inner.loss(model, batch)
        term = self.balancing.take(batch).to(summed.device)
        units = self.count(batch).to(summed.device, summed.dtype)
        total = summed + self.balancing.coefficient * term * units
        return total, torch.cat([sums.to(summed.device), (term.detach() * units).reshape(1)])

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        load = self.balancing.load_metrics(lambda load: accelerator.reduce(load, "sum"))
        return self.inner.periodic_metrics(accelerator) | load

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        return self.inner.evaluate(model, loader, accelerator)
