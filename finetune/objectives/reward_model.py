"""Reward models: a scalar score per sequence, trained on chosen/rejected pairs (Bradley-Terry), averaged over
every pair of a step.

The model is the base as a sequence classifier with one output (`finetune.model.score_head`: its `score` head on
the last hidden state, read raw). Each micro-batch's chosen and rejected sequences go through one forward, packed
or padded as preference tuning packs them (`finetune.data.preference.collate_pairs`), and each sequence's score is
read at its last token (`last_index`): the end of the reply as the template ends it. Packed rows hold many
sequences, which transformers' classifier forward (one score per row, at its last non-pad token) cannot read, so
the head's forward is swapped for one call of the model, as the chunked loss swaps the LM head's
(`finetune.objectives.loss.head_forward`): it scores the hidden states at those positions only, and the scores
leave the model as its output, where FSDP hooks its backward.

Each pair's loss is -log sigmoid(r_chosen - r_rejected - margin) (`margin`: the data's column, 0 without it),
plus reward_model.center_rewards_coefficient x (r_chosen + r_rejected)^2: TRL's RewardTrainer's, whose mean over
a batch is this sum over the step's pairs divided by their count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.config import RewardModelConfig
from finetune.data.preference import SCORED_PAIRS
from finetune.engine.batch import Batch
from finetune.engine.sequence import sequence_parallel
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError
from finetune.model.dropout import disable_dropout
from finetune.model.score_head import score_head
from finetune.objectives.loss import head_forward, model_inputs

if TYPE_CHECKING:
    from finetune.objectives import BuildContext

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def sequence_scores(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Each sequence's score, read at its last token (`last_index`, in the rows flattened): shape (sequences,),
    fp32, differentiable when gradients are enabled."""
    head, index = score_head(model), batch["last_index"]

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.to(hidden.device))
        scores = type(head).forward(head, picked).reshape(-1).float()  # the head's own forward (PEFT's trained copy)
        # Every position holds every score: the classifier's pooling (one position per row) then returns them all.
        return scores.view(1, 1, -1).expand(*hidden.shape[:2], -1)

    with head_forward(head, forward):
        return model(**model_inputs(model, batch), use_cache=False).logits[0]


@dataclass(frozen=True)
class PairScores:
    losses: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor

    def per_pair(self) -> list[torch.Tensor]:
        """Each metric of METRICS, per pair."""
        chosen, rejected = self.chosen.detach(), self.rejected.detach()
        return [chosen, rejected, chosen - rejected, (chosen > rejected).float()]


def pair_losses(scores: torch.Tensor, margin: torch.Tensor, center: float | None) -> PairScores:
    """Each pair's loss from the scores of its chosen sequences, then its rejected ones."""
    chosen, rejected = scores.chunk(2)
    losses = -F.logsigmoid(chosen - rejected - margin.to(scores.device))
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return PairScores(losses, chosen, rejected)


@dataclass
class RewardModel:
    cfg: RewardModelConfig
    unit_name: str = "pairs"
    metric_names: tuple[str, ...] = METRICS
    progress_name: str | None = "rewards/accuracies"
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
        index = batch["pair_index"]
        return torch.full((), index.shape[0], dtype=torch.float64, device=index.device)

    def scores(self, model: torch.nn.Module, batch: Batch) -> PairScores:
        return pair_losses(sequence_scores(model, batch), batch["margin"], self.cfg.center_rewards_coefficient)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.scores(model, batch)
        return result.losses.sum(), torch.stack([metric.sum() for metric in result.per_pair()])

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """The loss and metrics averaged over every held-out pair (each counted once, whatever the process count)."""
        model.eval()
        sums = torch.zeros(1 + len(METRICS), dtype=torch.float64)
        pairs = 0
        for batch in loader:
            result = self.scores(model, batch)
            per_pair = torch.stack([result.losses, *result.per_pair()], dim=1)
            per_pair = accelerator.gather_for_metrics(per_pair)  # without the pairs repeated to even out processes
            sums += per_pair.double().sum(dim=0).cpu()
            pairs += per_pair.shape[0]
        reshard(model)
        model.train()
        means = (sums / max(pairs, 1)).tolist()
        return {"loss": means[0], **dict(zip(METRICS, means[1:], strict=True))}


class RewardModelBuilder:
    """A reward model as the build knows it (`finetune.objectives.ObjectiveBuilder`): pairs, a scalar head
    (`head`), dropout off (both sides of a pair scored by one network)."""

    name = "reward_model"
    unit_noun = "pairs"
    samples = SCORED_PAIRS
    head = "score"
    reference_model = None
    reference_setting = ""

    def __init__(self, cfg: RewardModelConfig):
        self.cfg = cfg

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        dropped = disable_dropout(model)
        if dropped:
            accelerator.print(f"dropout: off for a reward model ({dropped})")

    def build(self, context: BuildContext) -> tuple[RewardModel, Callable[[], None]]:
        if sequence_parallel(context.accelerator) is not None:
            raise FinetuneError(
                "a reward model reads each sequence's score at its last token, which sequence parallelism places on "
                "one process of the group; launch without a sequence group (parallelism_config_sp_size 1)"
            )
        return RewardModel(self.cfg), lambda: None
