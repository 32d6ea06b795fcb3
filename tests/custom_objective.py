"""An objective defined outside finetune, as a user would write one: cross-entropy with each target token weighted
(the end-of-sequence token by `eos_weight`, every other by 1), averaged over the step's total weight. A recipe trains
it with `train.objective=tests.custom_objective:uniform` (or `:eos_heavy`); tests/test_objectives.py proves that it
runs through the real loop, build, metrics and checkpoints, none of which knows it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.config import RecipeConfig
from finetune.data import IGNORE, SEQUENCES
from finetune.engine.wrap import reshard
from finetune.objectives import BuildContext
from finetune.objectives.loss import model_inputs


@dataclass(frozen=True)
class WeightedTokens:
    eos_weight: float
    eos_id: int
    unit_name: str = "token_weight"
    metric_names: tuple[str, ...] = ("eos_loss",)
    progress_name: str | None = "eos_loss"

    def weights(self, targets: torch.Tensor) -> torch.Tensor:
        weight = torch.where(targets == self.eos_id, self.eos_weight, 1.0)
        return weight * (targets != IGNORE)

    def count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.weights(batch["target_ids"]).sum()

    def token_losses(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        targets = batch["target_ids"]
        logits = model(**model_inputs(model, batch), use_cache=False).logits
        logits = logits.float().flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="none").view_as(targets)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        losses = self.token_losses(model, batch)
        weights = self.weights(batch["target_ids"]).to(losses.device)
        eos = (losses.detach() * weights * (batch["target_ids"] == self.eos_id).to(losses.device)).sum()
        return (losses * weights).sum(), eos.reshape(1)

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        for batch in loader:
            losses = self.token_losses(model, batch)
            weights = self.weights(batch["target_ids"]).to(losses.device)
            rows = torch.stack([(losses * weights).sum(dim=1), weights.sum(dim=1)], dim=1)
            sums += accelerator.gather_for_metrics(rows).double().sum(dim=0).cpu()
        reshard(model)
        model.train()
        return {"loss": (sums[0] / sums[1].clamp(min=1)).item()}


class WeightedTokensBuilder:
    name = "weighted_tokens"
    unit_noun = "sequences"
    samples = SEQUENCES
    reference_model = None

    def __init__(self, eos_weight: float):
        self.eos_weight = eos_weight

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        return None

    def build(self, context: BuildContext) -> tuple[WeightedTokens, object]:
        eos_id = context.accelerator.unwrap_model(context.model).config.eos_token_id
        return WeightedTokens(self.eos_weight, eos_id), lambda: None


def uniform(recipe: RecipeConfig) -> WeightedTokensBuilder:
    """Every target token weighted 1: supervised fine-tuning's loss, through the full logits."""
    return WeightedTokensBuilder(1.0)


def eos_heavy(recipe: RecipeConfig) -> WeightedTokensBuilder:
    return WeightedTokensBuilder(3.0)
