"""Preference tuning: DPO, IPO, SimPO and ORPO on chosen/rejected pairs, averaged over every pair of a step.

Each micro-batch's chosen and rejected sequences go through one forward (packed or padded rows,
`finetune.data.preference.collate_pairs`); their log-probabilities are the sums of their reply tokens'
(`finetune.objectives.loss.sequence_logps`, never the logits whole). The reference the DPO and IPO losses compare
against comes from one of:

- `precomputed`: the initial weights' log-probabilities of every pair, computed once before the first
  step (`finetune.objectives.reference`) and looked up by the pair's index;
- `adapters`: the same model with its adapters switched off (adapter runs: the base is the reference);
- `model`: a second frozen model (`preference.reference_model`), sharded with the policy's per-layer units;
- none, for the reference-free SimPO and ORPO.

Rewards (logged, not trained): beta x the log-ratio to the reference for DPO and IPO, beta x the
average log-probability for SimPO and ORPO, as TRL logs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.config import PreferenceConfig
from finetune.data.preference import PAIR_SAMPLES
from finetune.engine.batch import Batch
from finetune.engine.sequence import SequenceParallel, gather_rows, sequence_parallel
from finetune.engine.wrap import reshard
from finetune.model.dropout import disable_dropout
from finetune.model.weights import BaseSwitch
from finetune.objectives.loss import LossPath, sequence_logps
from finetune.objectives.reference import chosen_reference

if TYPE_CHECKING:
    from finetune.objectives import BuildContext

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


@dataclass(frozen=True)
class PairLosses:
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_losses(
    cfg: PreferenceConfig,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
) -> PairLosses:
    """Each pair's loss from the summed log-probabilities of its replies (`chosen`, `rejected`), the
    reference's (None for reference-free losses) and the replies' token counts. IPO, SimPO and ORPO
    compare average log-probabilities (per reply token), DPO sums."""
    beta, smoothing = cfg.beta, cfg.label_smoothing
    chosen_avg, rejected_avg = chosen / chosen_tokens, rejected / rejected_tokens
    if cfg.loss in ("dpo", "ipo"):
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        if cfg.loss == "dpo":
            logits = beta * (chosen_ratio - rejected_ratio)
            # label smoothing: the labels are trusted with probability 1 - smoothing (conservative DPO)
            losses = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
        else:
            delta = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
            losses = (delta - 1 / (2 * beta)) ** 2
    elif cfg.loss == "simpo":
        logits = beta * (chosen_avg - rejected_avg) - cfg.gamma
        losses = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
        chosen_rewards, rejected_rewards = beta * chosen_avg, beta * rejected_avg
    else:  # orpo: the chosen reply's likelihood, and its odds against the rejected one's
        log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
        losses = -chosen_avg - beta * F.logsigmoid(log_odds)
        chosen_rewards, rejected_rewards = beta * chosen_avg, beta * rejected_avg
    if cfg.sft_weight:
        losses = losses - cfg.sft_weight * chosen_avg  # the chosen reply's mean negative log-likelihood, per pair
    return PairLosses(losses, chosen_rewards.detach(), rejected_rewards.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without the cancellation either form has on its own."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass
class Preference:
    cfg: PreferenceConfig
    loss_path: LossPath
    reference: str
    """precomputed, adapters or none (PreferenceConfig.reference resolved for the run)."""
    reference_logps: torch.Tensor | None = None
    """precomputed: (pairs, 2), the reference's chosen and rejected log-probabilities, by pair index."""
    reference_model: torch.nn.Module | None = None
    """model: the frozen reference, sharded as the policy is (`wrap.shard_frozen`)."""
    base_switch: BaseSwitch | None = None
    """adapters: what switches the policy's adapters off (the weights seam's `base_switch`)."""
    sequence: SequenceParallel | None = None
    """Under sequence parallelism: each process holds slices of the pairs' sequences, whose log-probabilities the
    group adds up; every process of the group then has the pairs' losses, which its first process counts."""
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

    @property
    def share(self) -> float:
        return self.sequence.share if self.sequence is not None else 1.0

    def count(self, batch: Batch) -> torch.Tensor:
        index = batch["pair_index"]
        return torch.full((), index.shape[0] * self.share, dtype=torch.float64, device=index.device)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        result, policy = self._pairs(model, batch)
        return result.losses.sum() * self.share, _sums(result, policy) * self.share

    def _logps(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        logps = sequence_logps(model, batch, self.loss_path)
        return self.sequence.sum(logps) if self.sequence is not None else logps

    def _pairs(self, model: torch.nn.Module, batch: Batch) -> tuple[PairLosses, torch.Tensor]:
        pairs = batch["pair_index"].shape[0]
        policy = self._logps(model, batch)
        reference = self.reference_of(model, batch)
        tokens = batch["sequence_targets"].to(policy.device, torch.float32)
        result = pair_losses(
            self.cfg, policy[:pairs], policy[pairs:],
            reference[:pairs] if reference is not None else None, reference[pairs:] if reference is not None else None,
            tokens[:pairs], tokens[pairs:],
        )  # fmt: skip
        return result, policy.detach()

    def reference_of(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor | None:
        """The reference's log-probabilities of the batch's sequences (chosen, then rejected)."""
        if self.reference == "none":
            return None
        if self.reference == "model":
            with torch.no_grad():
                return self._logps(self.reference_model, batch)
        if self.reference == "adapters":
            with torch.no_grad(), self.base_switch(model):
                return self._logps(model, batch)
        table = self.reference_logps.index_select(0, batch["pair_index"].to(self.reference_logps.device))  # (pairs, 2)
        return torch.cat([table[:, 0], table[:, 1]]).to(batch["input_ids"].device, torch.float32)

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """The loss and metrics averaged over every held-out pair (each counted once, whatever the process count)."""
        model.eval()
        sums = torch.zeros(1 + len(METRICS), dtype=torch.float64)
        pairs = 0
        for batch in loader:
            result, policy = self._pairs(model, batch)
            per_pair = torch.stack([result.losses.detach(), *_per_pair(result, policy)], dim=1) * self.share
            # Without the pairs accelerate duplicated to give every process equal batches.
            (per_pair,) = gather_rows(accelerator, (per_pair,))
            sums += per_pair.double().sum(dim=0).cpu()
            pairs += per_pair.shape[0]
        reshard(model)
        model.train()
        means = (sums / max(pairs, 1)).tolist()
        return {"loss": means[0], **dict(zip(METRICS, means[1:], strict=True))}


def _per_pair(result: PairLosses, policy: torch.Tensor) -> list[torch.Tensor]:
    """Each metric of METRICS, per pair."""
    pairs = result.losses.shape[0]
    chosen, rejected = result.chosen_rewards, result.rejected_rewards
    accurate = (chosen > rejected).float()
    return [chosen, rejected, chosen - rejected, accurate, policy[:pairs], policy[pairs:]]


def _sums(result: PairLosses, policy: torch.Tensor) -> torch.Tensor:
    return torch.stack([metric.sum() for metric in _per_pair(result, policy)])


class PreferenceBuilder:
    """Preference tuning as the build knows it (`finetune.objectives.ObjectiveBuilder`): pairs, dropout off, and
    the reference the loss compares against."""

    name = "preference"
    unit_noun = "pairs"
    samples = PAIR_SAMPLES
    reference_setting = "preference.reference_model"

    def __init__(self, cfg: PreferenceConfig):
        self.cfg = cfg
        self.reference_model = cfg.reference_model

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        dropped = disable_dropout(model)  # the policy and its reference must agree at step 1
        if dropped:
            accelerator.print(f"dropout: off for preference tuning ({dropped})")

    def build(self, context: BuildContext) -> tuple[Preference, Callable[[], None]]:
        """A preference run with a precomputed reference computes it here (collective), or reads it: from the
        output dir when resuming, from beside the tokenized data when this base and data computed it before."""
        reference = chosen_reference(self.cfg, context)
        objective = Preference(
            self.cfg, context.loss_path, reference.kind, reference_logps=reference.logps,
            reference_model=reference.model, base_switch=reference.base_switch,
            sequence=sequence_parallel(context.accelerator),
        )  # fmt: skip
        return objective, reference.write
