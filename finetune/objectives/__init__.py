"""What a run minimizes: the seam between the loop and the kind of training.

An objective owns what the loop would otherwise branch on: the unit a step's loss is averaged over
(target tokens for supervised fine-tuning, pairs for preference tuning), the summed loss of a
micro-batch with the metrics it logs, and evaluation. The loop asks it and never looks inside:

    count(batch)        -> how many units the micro-batch holds (a CPU tensor the collator made)
    loss(model, batch)  -> (summed loss over those units, differentiable; the metrics' sums, detached)
    evaluate(...)       -> the eval metrics over a whole loader, each unit counted once
    periodic_metrics()  -> what it gathered between logs (a mixture of experts' load per layer), or {}

Normalization is the loop's: a step minimizes (sum of unit losses) / (units in the whole step, over
all micro-batches and processes), so any split of the same global batch gives the same update.
"""

from __future__ import annotations

from typing import Protocol

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.objectives.balanced import Balanced
from finetune.objectives.preference import Preference
from finetune.objectives.supervised import Supervised

__all__ = ["Balanced", "Objective", "Preference", "Supervised"]


class Objective(Protocol):
    unit_name: str
    """What a step's loss is averaged over, as metrics.jsonl names its count: target_tokens, or pairs."""
    metric_names: tuple[str, ...]
    """What `loss` sums besides the loss, in order; logged as each sum over the step's units."""
    progress_name: str | None
    """The metric the progress bar shows beside the loss, if any."""

    def count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]: ...

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """What the objective gathered since the last log (a collective: every process calls it), logged with
        the step's metrics; {} for objectives that gather nothing between logs."""
        ...
