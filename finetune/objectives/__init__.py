"""What a run minimizes: the seam between the loop and the kind of training.

An objective owns what the loop would otherwise branch on: the unit a step's loss is averaged over
(target tokens for supervised fine-tuning, pairs for preference tuning), the summed loss of a
micro-batch with the metrics it logs, and evaluation. The loop asks it and never looks inside:

    count(batch)        -> how many units the micro-batch holds (a CPU tensor the collator made)
    loss(model, batch)  -> (summed loss over those units, differentiable; the metrics' sums, detached)
    evaluate(...)       -> the eval metrics over a whole loader, each unit counted once
    periodic_metrics()  -> what it gathered between logs (a mixture of experts' load per layer), or {}
    rollout(...)        -> the step's micro-batches as the loss takes them: as loaded, or (online RL) the
                           completions the model samples for their prompts, trained on `steps_per_window` steps

Before it exists, the build asks its builder (`objective_for`, chosen once from the recipe) what the objective
trains on (its samples and their batching), how the model is prepared for it (dropout off for preference
tuning), its name (stored in checkpoints) and unit noun (the log's batch line), and then builds it from the
prepared run (`BuildContext`): a reference model or a precomputed reference table is the builder's business.
A new objective is a module here with both; a recipe names one of its own with `train.objective`.

Normalization is the loop's: a step minimizes (sum of unit losses) / (units in the whole step, over
all micro-batches and processes), so any split of the same global batch gives the same update.

An objective whose metrics are not all means over the step's units names, in `metric_units`, the metric whose sum
divides each of the others (KTO's rewards of desirable samples, over the desirable samples).

Beside the objectives (`supervised`, `preference`, `kto`, `grpo`, `distill`, `reward_model`, `balanced`) live what they
share: the losses and their chunked paths (`loss`, `divergence`), online RL's advantages and policy loss (`advantages`,
`policy_loss`), frozen reference models and precomputed references (`reference`) and a teacher's top-k table
(`teacher_table`).

May import: `rollouts`, `model`, `storage`, `data`, `engine`, `config`, `errors`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.config import RecipeConfig
from finetune.engine.batch import Batch
from finetune.errors import imported
from finetune.objectives.balanced import WithBalancingLoss
from finetune.objectives.distill import Distill, DistillBuilder
from finetune.objectives.grpo import GRPO, GRPOBuilder
from finetune.objectives.kto import KTO, KTOBuilder
from finetune.objectives.preference import Preference, PreferenceBuilder
from finetune.objectives.reward_model import RewardModel, RewardModelBuilder
from finetune.objectives.supervised import Supervised, SupervisedBuilder

if TYPE_CHECKING:
    from finetune.data import Data, Samples
    from finetune.model.weights import Weights
    from finetune.objectives.loss import LossPath

__all__ = [
    "GRPO", "KTO", "WithBalancingLoss", "BuildContext", "Distill", "Objective", "ObjectiveBuilder", "Preference",
    "RewardModel", "Supervised", "objective_for", "with_rollout",
]  # fmt: skip


class Objective(Protocol):
    unit_name: str
    """What a step's loss is averaged over, as metrics.jsonl names its count: target_tokens, or pairs."""
    metric_names: tuple[str, ...]
    """What `loss` sums besides the loss, in order; logged as each sum over the step's units."""
    progress_name: str | None
    """The metric the progress bar shows beside the loss, if any."""
    steps_per_window: int
    """Optimizer steps each window of micro-batches trains (online RL's num_iterations; 1 for the others)."""

    def rollout(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        step: int,
        accelerator: Accelerator,
        draw: Callable[[], list[Batch]] | None = None,
    ) -> list[Batch]:
        """The micro-batches step `step` trains on, made from those loaded (a collective where it generates);
        `draw` loads the next window of micro-batches (every process at once), for an objective that needs more
        than the step's own (online RL's dynamic sampling): the data a later step would have trained on."""
        ...

    def count(self, batch: Batch) -> torch.Tensor: ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]: ...

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """What the objective gathered since the last log (a collective: every process calls it), logged with
        the step's metrics; {} for objectives that gather nothing between logs."""
        ...


@dataclass(frozen=True)
class BuildContext:
    """What an objective is built from: the run as built and prepared (model sharded, data loaded)."""

    recipe: RecipeConfig
    accelerator: Accelerator
    model: torch.nn.Module
    data: Data
    loss_path: LossPath
    weights: Weights
    resume_from: Path | None
    tokenizer: PreTrainedTokenizerBase


class ObjectiveBuilder(Protocol):
    name: str
    """Stored in every checkpoint: a run resumes under the objective it trained with only."""
    unit_noun: str
    """What a row of a micro-batch is, in the log's batch line: sequences, pairs."""
    samples: Samples
    """What it trains on, as `finetune.data.build_data` reads, tokenizes and batches it."""
    reference_model: str | None
    """A second model it loads (checked with the tokenizer before any weight loads), or None."""
    reference_setting: str
    """The recipe setting that names it, for the messages that refuse it (`preference.reference_model`)."""
    head: str
    """What the model outputs: `lm` (a causal LM's logits; assumed where a builder of your own lacks it) or `score`
    (a reward model's scalar, `finetune.model.score_head`)."""

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        """Anything the objective needs of the model before it is sharded."""
        ...

    def build(self, context: BuildContext) -> tuple[Objective, Callable[[], None]]:
        """The objective, and what writes its files into the output dir once that is claimed (main process)."""
        ...


@dataclass(frozen=True)
class AsLoaded:
    """An objective without `rollout` and `steps_per_window` (one of your own written before online RL added
    them): it trains on the micro-batches as loaded, each window for one step; everything else is its own."""

    inner: Objective
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

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def with_rollout(objective: Objective) -> Objective:
    """The objective as the loop asks it, `rollout` and `steps_per_window` included."""
    return objective if hasattr(objective, "rollout") else AsLoaded(objective)


def objective_for(recipe: RecipeConfig) -> ObjectiveBuilder:
    """The recipe's objective: `train.objective` (a `module:attribute` taking the recipe and returning an
    ObjectiveBuilder), else online RL with an `rl` section, preference tuning with a `preference` section (KTO
    with its loss kto), distillation with a `distill` section, a reward model with a `reward_model` section, else
    supervised fine-tuning."""
    if recipe.train.objective is not None:
        return _imported(recipe.train.objective)(recipe)
    if recipe.rl is not None:
        return GRPOBuilder(recipe.rl, recipe.model)
    if recipe.preference is not None:
        kto = recipe.preference.loss == "kto"
        return KTOBuilder(recipe.preference) if kto else PreferenceBuilder(recipe.preference)
    if recipe.distill is not None:
        return DistillBuilder(recipe.distill, recipe.data, recipe.model)
    if recipe.reward_model is not None:
        return RewardModelBuilder(recipe.reward_model)
    return SupervisedBuilder()


def _imported(name: str) -> Callable[[RecipeConfig], ObjectiveBuilder]:
    return imported(name, "train.objective", "a function or class")
