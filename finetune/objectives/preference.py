"""Preference tuning: DPO, IPO, SimPO and ORPO on chosen/rejected pairs, averaged over every pair of a step.

Each micro-batch's chosen and rejected sequences go through one forward (packed or padded rows,
`finetune.data.preference.collate_pairs`); their log-probabilities are the sums of their reply tokens'
(`finetune.loss.sequence_logps`, never the logits whole). The reference the DPO and IPO losses compare
against comes from one of:

- `precomputed`: the initial weights' log-probabilities of every pair, computed once before the first
  step (`finetune.reference`) and looked up by the pair's index;
- `adapters`: the same model with its adapters switched off (adapter runs: the base is the reference);
- `model`: a second frozen model (`preference.reference_model`), sharded with the policy's per-layer units;
- none, for the reference-free SimPO and ORPO.

Rewards (logged, not trained): beta x the log-ratio to the reference for DPO and IPO, beta x the
average log-probability for SimPO and ORPO, as TRL logs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.config import PreferenceConfig
from finetune.loss import LossPath, sequence_logps
from finetune.wrap import reshard

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
    unit_name: str = "pairs"
    metric_names: tuple[str, ...] = METRICS
    progress_name: str | None = "rewards/accuracies"

    def count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        index = batch["pair_index"]
        return torch.full((), index.shape[0], dtype=torch.int64, device=index.device)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        result, policy = self._pairs(model, batch)
        return result.losses.sum(), _sums(result, policy)

    def _pairs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[PairLosses, torch.Tensor]:
        pairs = batch["pair_index"].shape[0]
        policy = sequence_logps(model, batch, self.loss_path)
        reference = self.reference_of(model, batch)
        tokens = batch["sequence_targets"].to(policy.device, torch.float32)
        result = pair_losses(
            self.cfg, policy[:pairs], policy[pairs:],
            reference[:pairs] if reference is not None else None, reference[pairs:] if reference is not None else None,
            tokens[:pairs], tokens[pairs:],
        )  # fmt: skip
        return result, policy.detach()

    def reference_of(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The reference's log-probabilities of the batch's sequences (chosen, then rejected)."""
        if self.reference == "none":
            return None
        if self.reference == "model":
            with torch.no_grad():
                return sequence_logps(self.reference_model, batch, self.loss_path)
        if self.reference == "adapters":
            from finetune.adapters import adapters_disabled

            with torch.no_grad(), adapters_disabled(model):
                return sequence_logps(model, batch, self.loss_path)
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
            per_pair = torch.stack([result.losses.detach(), *_per_pair(result, policy)], dim=1)
            # gather_for_metrics drops the pairs accelerate duplicated to give every process equal batches.
            per_pair = accelerator.gather_for_metrics(per_pair)
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
