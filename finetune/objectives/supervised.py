"""Supervised fine-tuning: next-token cross-entropy, averaged over every target token of a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.data import SEQUENCES
from finetune.engine.batch import IGNORE, Batch
from finetune.engine.sequence import gather_rows
from finetune.engine.wrap import reshard
from finetune.objectives.loss import LossPath, batch_loss


@dataclass(frozen=True)
class Supervised:
    loss_path: LossPath
    unit_name: str = "target_tokens"
    metric_names: tuple[str, ...] = ()
    progress_name: str | None = None
    steps_per_window: int = 1

    def rollout(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        step: int,
        accelerator: Accelerator,
        draw: Callable[[], list[Batch]] | None = None,
    ) -> list[Batch]:
        return micro_batches

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch["target_ids"] != IGNORE).sum()

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_loss(model, batch, self.loss_path).total, torch.zeros(0)

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """Mean loss per target token over the whole eval set (each row counted once, whatever the process count)."""
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64)
        num_targets = torch.zeros((), dtype=torch.float64)
        for batch in loader:
            row_losses = batch_loss(model, batch, self.loss_path).per_row
            row_targets = (batch["target_ids"] != IGNORE).sum(dim=1)
            # Without the rows accelerate duplicated to give every process equal batches.
            row_losses, row_targets = gather_rows(accelerator, (row_losses, row_targets))
            loss_sum += row_losses.double().sum().cpu()
            num_targets += row_targets.double().sum().cpu()
        reshard(model)
        model.train()
        return {"loss": (loss_sum / num_targets.clamp(min=1)).item()}


class SupervisedBuilder:
    """Supervised fine-tuning as the build knows it (`finetune.objectives.ObjectiveBuilder`)."""

    name = "supervised"
    unit_noun = "sequences"
    samples = SEQUENCES
    reference_model = None
    reference_setting = ""

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        return None

    def build(self, context) -> tuple[Supervised, object]:
        return Supervised(context.loss_path), lambda: None
