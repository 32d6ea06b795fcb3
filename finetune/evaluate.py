"""Evaluation loss: summed over every target token of the eval set, across all processes."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.data import IGNORE
from finetune.loss import LossPath, batch_loss
from finetune.wrap import reshard


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator, loss_path: LossPath) -> float:
    """Mean loss per target token over the whole eval set (each row counted once, whatever the process count)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    num_targets = torch.zeros((), dtype=torch.float64)
    for batch in loader:
        row_losses = batch_loss(model, batch, loss_path).per_row
        row_targets = (batch["target_ids"] != IGNORE).sum(dim=1)
        # gather_for_metrics drops the rows accelerate duplicated to give every process equal batches.
        row_losses, row_targets = accelerator.gather_for_metrics((row_losses, row_targets))
        loss_sum += row_losses.double().sum().cpu()
        num_targets += row_targets.double().sum().cpu()
    reshard(model)
    model.train()
    return (loss_sum / num_targets.clamp(min=1)).item()
