"""Evaluation loss: summed over every target token of the eval set, across all processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.data import IGNORE
from finetune.wrap import reshard

MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token cross-entropy (0 where the target is IGNORE), shape (batch, seq)."""
    inputs = {key: value for key, value in batch.items() if key in MODEL_INPUTS}
    logits = model(**inputs, use_cache=False).logits  # a KV cache only costs memory here
    targets = batch["target_ids"]
    # Upcast so that a bf16 forward does not also give a bf16 loss.
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return losses.view_as(targets)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> float:
    """Mean loss per target token over the whole eval set (each row counted once, whatever the process count)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    num_targets = torch.zeros((), dtype=torch.float64)
    for batch in loader:
        row_losses = token_losses(model, batch).sum(dim=1)
        row_targets = (batch["target_ids"] != IGNORE).sum(dim=1)
        # gather_for_metrics drops the rows accelerate duplicated to give every process equal batches.
        row_losses, row_targets = accelerator.gather_for_metrics((row_losses, row_targets))
        loss_sum += row_losses.double().sum().cpu()
        num_targets += row_targets.double().sum().cpu()
    reshard(model)
    model.train()
    return (loss_sum / num_targets.clamp(min=1)).item()
