"""KTO (Ethayarajh et al., 2024): learning from completions labelled desirable or undesirable, without pairs,
averaged over every sample of a step.

A sample's reward is r = log pi(y|x) - log pi_ref(y|x), its completion's summed log-probability ratio to the
reference (`finetune.objectives.loss.sequence_logps`; the reference precomputed, the model with its adapters off,
or a second frozen model, as for DPO). Each is compared with the reference point z0, the policy's mean log-ratio on
completions that do not answer their prompt: a desirable sample's loss is w_d (1 - sigmoid(beta (r - z0))), an
undesirable one's w_u (1 - sigmoid(beta (z0 - r))). z0 is held fixed (no gradient) and clamped at 0.

z0 is estimated for each step from all of its samples, on every process, before the step's first backward
(`rollout`): each sample's prompt with its partner's completion (`finetune.data.unpaired`), the policy's and the
reference's log-probabilities under no_grad, their mean difference over the step. TRL's KTOTrainer takes the mean
over processes of each device's micro-batch mean instead; on one process and one micro-batch the two are the same
number, and only the step's estimate keeps 1 process = N processes and any micro-batch split one update. Evaluation
estimates z0 once over the whole held-out set.

Logged: the loss, `kl` (z0), the mean reward and log-probability of the desirable samples (`rewards/chosen`,
`logps/chosen`) and of the undesirable ones (`rewards/rejected`, `logps/rejected`), each over its own kind's
samples, and the share of each kind (`desirable`, `undesirable`); evaluation adds `rewards/margins`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.config import PreferenceConfig
from finetune.data.unpaired import UNPAIRED_SAMPLES, UnpairedStats, kl_view
from finetune.engine.batch import Batch
from finetune.engine.sequence import gather_rows, sequence_parallel
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError
from finetune.model.dropout import disable_dropout
from finetune.model.weights import BaseSwitch
from finetune.objectives.loss import LossPath, sequence_logps
from finetune.objectives.metrics import unit_means
from finetune.objectives.reference import chosen_reference

if TYPE_CHECKING:
    from finetune.objectives import BuildContext

METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "desirable", "undesirable", "kl")
METRIC_UNITS = {"rewards/chosen": "desirable", "logps/chosen": "desirable", "rewards/rejected": "undesirable",
                "logps/rejected": "undesirable"}  # fmt: skip
"""Each kind's means are over that kind's samples (`finetune.objectives.metrics.unit_means`)."""


@dataclass(frozen=True)
class SampleLosses:
    losses: torch.Tensor
    rewards: torch.Tensor
    """beta x the log-ratio to the reference, detached."""


def kto_losses(
    cfg: PreferenceConfig, policy: torch.Tensor, reference: torch.Tensor, point: torch.Tensor, labels: torch.Tensor
) -> SampleLosses:
    """Each sample's loss from its completion's summed log-probabilities under the policy and the reference, the
    reference point z0 and its label (true: desirable)."""
    ratio = policy - reference
    desirable_weight, undesirable_weight = cfg.weights
    desirable = desirable_weight * (1 - torch.sigmoid(cfg.beta * (ratio - point)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(cfg.beta * (point - ratio)))
    return SampleLosses(torch.where(labels, desirable, undesirable), cfg.beta * ratio.detach())


def kind_sums(result: SampleLosses, policy: torch.Tensor, labels: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    """The sums of METRICS over a micro-batch's samples."""
    desirable = labels.to(policy.dtype)
    undesirable = 1 - desirable
    return torch.stack([
        (result.rewards * desirable).sum(), (result.rewards * undesirable).sum(), (policy * desirable).sum(),
        (policy * undesirable).sum(), desirable.sum(), undesirable.sum(), point * labels.numel(),
    ])  # fmt: skip


@dataclass
class KTO:
    cfg: PreferenceConfig
    loss_path: LossPath
    reference: str
    """precomputed, adapters or model (PreferenceConfig.reference resolved for the run)."""
    reference_logps: torch.Tensor | None = None
    """precomputed: (samples, 2), the reference's log-probabilities of each sample and of its mismatched sequence."""
    reference_model: torch.nn.Module | None = None
    """model: the frozen reference, sharded as the policy is (`wrap.shard_frozen`)."""
    base_switch: BaseSwitch | None = None
    """adapters: what switches the policy's adapters off (the weights seam's `base_switch`)."""
    unit_name: str = "samples"
    metric_names: tuple[str, ...] = METRICS
    progress_name: str | None = "kl"
    steps_per_window: int = 1

    @property
    def metric_units(self) -> dict[str, str]:
        return METRIC_UNITS

    def rollout(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        step: int,
        accelerator: Accelerator,
        draw: Callable[[], list[Batch]] | None = None,
    ) -> list[Batch]:
        """The step's micro-batches, each carrying the step's reference point (`kl`)."""
        point = self.reference_point(model, micro_batches, accelerator)
        return [{**batch, "kl": point} for batch in micro_batches]

    @torch.no_grad()
    def reference_point(self, model: torch.nn.Module, batches: list[Batch], accelerator: Accelerator) -> torch.Tensor:
        """z0: the policy's mean log-ratio to the reference over the mismatched sequences of `batches` on every
        process (a collective), at least 0."""
        sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        for batch in batches:
            ratio = self.mismatched_ratios(model, batch)
            sums += torch.stack([ratio.double().sum(), torch.tensor(ratio.numel(), device=ratio.device)])
        reshard(model)
        sums = accelerator.reduce(sums, "sum")
        return (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()

    def mismatched_ratios(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        mismatched = kl_view(batch)
        return sequence_logps(model, mismatched, self.loss_path) - self.reference_of(model, mismatched, batch, 1)

    def count(self, batch: Batch) -> torch.Tensor:
        labels = batch["label"]
        return torch.full((), labels.shape[0], dtype=torch.float64, device=labels.device)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        policy = sequence_logps(model, batch, self.loss_path)
        with torch.no_grad():
            reference = self.reference_of(model, batch, batch, 0)
        labels, point = batch["label"].to(policy.device), batch["kl"]
        result = kto_losses(self.cfg, policy, reference, point, labels)
        return result.losses.sum(), kind_sums(result, policy.detach(), labels, point)

    def reference_of(self, model: torch.nn.Module, sequences: Batch, batch: Batch, column: int) -> torch.Tensor:
        """The reference's log-probabilities of `sequences`: `batch`'s own (column 0) or its mismatched ones (1)."""
        if self.reference == "model":
            return sequence_logps(self.reference_model, sequences, self.loss_path)
        if self.reference == "adapters":
            with self.base_switch(model):
                return sequence_logps(model, sequences, self.loss_path)
        index = batch["pair_index"].to(self.reference_logps.device)
        return self.reference_logps[:, column].index_select(0, index).to(sequences["input_ids"].device, torch.float32)

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """The loss and metrics over every held-out sample (each counted once, whatever the process count), against
        one reference point estimated from the whole held-out set."""
        model.eval()
        columns = []
        for batch in loader:
            policy = sequence_logps(model, batch, self.loss_path)
            ratio = policy - self.reference_of(model, batch, batch, 0)
            per_sample = torch.stack([batch["label"].to(policy), policy, ratio, self.mismatched_ratios(model, batch)])
            # Without the samples accelerate duplicated to give every process equal batches.
            (per_sample,) = gather_rows(accelerator, (per_sample.T.contiguous(),))
            columns.append(per_sample.double().cpu())
        reshard(model)
        model.train()
        labels, policy, ratio, mismatched = torch.cat(columns).T
        point = mismatched.mean().clamp(min=0)
        labels = labels.bool()
        result = kto_losses(self.cfg, ratio, torch.zeros_like(ratio), point, labels)
        sums = dict(zip(METRICS, kind_sums(result, policy, labels, point).tolist(), strict=True))
        means = unit_means(sums, len(labels), METRIC_UNITS)
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        return {"loss": result.losses.mean().item(), **means}


def sample_columns(model: torch.nn.Module, batch: Batch, loss_path: LossPath) -> torch.Tensor:
    """(samples, 2): each sample's log-probability and its mismatched sequence's (the precomputed reference's)."""
    return torch.stack([sequence_logps(model, batch, loss_path), sequence_logps(model, kl_view(batch), loss_path)], 1)


class KTOBuilder:
    """KTO as the build knows it (`finetune.objectives.ObjectiveBuilder`): labelled samples with their mismatched
    partners, dropout off, and the reference the log-ratios are taken against."""

    name = "kto"
    unit_noun = "samples"
    samples = UNPAIRED_SAMPLES
    head = "lm"
    reference_setting = "preference.reference_model"

    def __init__(self, cfg: PreferenceConfig):
        self.cfg = cfg
        self.reference_model = cfg.reference_model

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        dropped = disable_dropout(model)  # the policy and its reference must agree at step 1
        if dropped:
            accelerator.print(f"dropout: off for KTO ({dropped})")

    def build(self, context: BuildContext) -> tuple[KTO, Callable[[], None]]:
        accelerator = context.accelerator
        if sequence_parallel(accelerator) is not None:
            raise FinetuneError(
                "preference.loss=kto under sequence parallelism is not supported: launch without a sequence group "
                "(parallelism_config_sp_size 1), or use loss dpo on pairs"
            )
        if (advice := weight_advice(self.cfg, context.data.train_stats)) is not None:
            accelerator.print(advice)
        reference = chosen_reference(self.cfg, context, sample_columns, "samples")
        objective = KTO(self.cfg, context.loss_path, reference.kind, reference_logps=reference.logps,
                        reference_model=reference.model, base_switch=reference.base_switch)  # fmt: skip
        return objective, reference.write


def weight_advice(cfg: PreferenceConfig, stats: UnpairedStats) -> str | None:
    """A line for the log where the desirable and undesirable losses are weighted outside the range Ethayarajh et
    al. recommend: (desirable_weight x desirable samples) / (undesirable_weight x undesirable ones) in [1, 4/3]."""
    desirable_weight, undesirable_weight = cfg.weights
    ratio = desirable_weight * stats.num_desirable / (undesirable_weight * stats.num_undesirable)
    if 1 <= ratio <= 4 / 3 + 1e-9:
        return None
    low = undesirable_weight * stats.num_undesirable / stats.num_desirable
    return (
        f"note: the desirable samples weigh {ratio:.2f} x the undesirable ones ({stats.num_desirable:,} x "
        f"desirable_weight {desirable_weight:g} against {stats.num_undesirable:,} x undesirable_weight "
        f"{undesirable_weight:g}); the KTO paper keeps this between 1 and 4/3: e.g. preference.desirable_weight="
        f"{low:.3g} to {low * 4 / 3:.3g}"
    )
