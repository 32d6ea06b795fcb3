"""Distillation (the `distill` section): a frozen teacher's next-token distributions taught to the model.

Every trained token's loss is a divergence between the teacher's distribution and the student's at that position
(`finetune.objectives.divergence`: forward KL, reverse KL or GKD's generalized JSD, of the logits over a temperature),
plus `sft_weight` x the token's cross-entropy; a step averages it over its trained tokens, as supervised fine-tuning
does. The teacher is loaded frozen, without dropout, and sharded with the student's per-layer units
(`finetune.objectives.reference.frozen_model`); it runs a forward on each micro-batch before the student's.

Which tokens train is the step's choice, drawn from the run's seed and the step's number (the same on any process
count, and on resume), with probability `on_policy_fraction`:

- off-policy: the data's replies, as loaded (packed or padded, every trained token of every sample);
- on-policy: the student's own completions of each sample's prompt (its tokens before its last reply, which the
  completion replaces: earlier replies of a conversation are context then, not trained), sampled at the
  temperature with seeded noise (`finetune.rollouts.generation`) whose seed is the run's, the step's and the sample's
  place in the step's batch, never the process's: the same completions on any process count. GKD's on-policy
  distillation: the teacher grades what the student would say, token by token.

With `estimator: sampled` every step is on-policy and a token's loss is the reverse KL's estimate at the token the
student sampled (`finetune.objectives.divergence.sampled_reverse_kl`). Evaluation reports the divergence over the
whole vocabulary on the held-out replies either way, so that runs of either estimator compare.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig, DistillConfig, ModelConfig
from finetune.data import NUMBERED_SEQUENCES, SEQUENCES
from finetune.data.pack import with_host_indices
from finetune.data.rollout import reply_prompts, separate_rows
from finetune.engine.batch import IGNORE, Batch
from finetune.engine.sequence import gather_rows
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError
from finetune.model.identity import same_weights
from finetune.model.loading import base_fingerprint
from finetune.objectives.divergence import Spec, TopK, distill_losses, sampled_reverse_kl
from finetune.objectives.loss import LossPath, chunked_loss_unsupported, target_positions
from finetune.objectives.reference import frozen_dtype, frozen_model
from finetune.objectives.teacher_table import (
    MICRO_BATCHES_PER_FORWARD,
    UNCACHED,
    TeacherTable,
    compute_table,
    read_table,
    table_folder,
    table_key,
)
from finetune.rollouts.generation import Sampling, cut_short, gathers_once, row_noise, sample_rollout, stop_tokens

ON_POLICY_STREAM = 0xD157
"""Mixed into the seed of the per-step draw of on-policy steps, apart from every other seeded draw of the run."""


def on_policy(seed: int, step: int, fraction: float) -> bool:
    """Whether step `step` trains on the model's own completions: a draw from the run's seed and the step alone."""
    return fraction > 0 and numpy.random.default_rng([seed, step, ON_POLICY_STREAM]).random() < fraction


@dataclass
class _Window:
    """What on-policy steps sampled since the last log, on this process."""

    steps: int = 0
    on_policy_steps: int = 0
    completions: int = 0
    tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0

    def metrics(self, accelerator: Accelerator) -> dict[str, float]:
        device = accelerator.device
        counted = torch.tensor([self.completions, self.tokens, self.truncated], dtype=torch.float64, device=device)
        completions, tokens, truncated = accelerator.reduce(counted, "sum").cpu().tolist()
        seconds = torch.tensor(self.seconds, dtype=torch.float64, device=device)
        if accelerator.num_processes > 1:  # the slowest process's: the others wait for it
            torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        values = {"on_policy": self.on_policy_steps / max(self.steps, 1)} if self.steps else {}
        if completions:
            values |= {
                "completions/mean_length": tokens / completions, "completions/clipped_ratio": truncated / completions,
                "generation/tokens_per_second": tokens / max(seconds.item(), 1e-9),
            }  # fmt: skip
        self.steps = self.on_policy_steps = self.completions = self.tokens = self.truncated = 0
        self.seconds = 0.0
        return values


@dataclass
class Distill:
    """The distill objective (`finetune.objectives.Objective`)."""

    cfg: DistillConfig
    loss_path: LossPath
    teacher: torch.nn.Module | TeacherTable
    """The frozen teacher, or its precomputed top-k table (distill.teacher_top_k)."""
    tokenizer: PreTrainedTokenizerBase
    seed: int
    max_length: int
    """data.max_length: no on-policy row is longer."""
    gather_once: bool = True
    window: _Window = field(default_factory=_Window)
    unit_name: str = "target_tokens"
    metric_names: tuple[str, ...] = ("divergence", "cross_entropy")
    progress_name: str | None = "divergence"
    steps_per_window: int = 1

    @property
    def spec(self) -> Spec:
        return Spec(self.cfg.divergence, self.cfg.beta, self.cfg.temperature, self.cfg.sft_weight)

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch["target_ids"] != IGNORE).sum()

    def teacher_of(self, batch: Batch) -> torch.nn.Module | TopK:
        """What grades the batch: the teacher, or its table's entries for the batch's rows."""
        if isinstance(self.teacher, TeacherTable):
            return self.teacher.lookup(batch["row_index"], batch["target_ids"].device)
        return self.teacher

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.estimator == "sampled":  # every step's tokens are the student's samples (the recipe says so)
            losses = sampled_reverse_kl(model, self.teacher, batch, self.loss_path, self.spec)
            return losses.total, losses.divergence.sum().reshape(1)
        losses = distill_losses(model, self.teacher_of(batch), batch, self.loss_path, self.spec)
        return losses.total, torch.stack([losses.divergence.sum(), losses.cross_entropy.sum()])

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return self.window.metrics(accelerator)

    def rollout(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        step: int,
        accelerator: Accelerator,
        draw: Callable[[], list[Batch]] | None = None,
    ) -> list[Batch]:
        """The data's micro-batches, or on an on-policy step the model's completions of their prompts (collective:
        every process generates at once, as every process draws the same steps)."""
        self.window.steps += 1
        if not on_policy(self.seed, step, self.cfg.on_policy_fraction):
            return micro_batches
        self.window.on_policy_steps += 1
        processes, me = accelerator.num_processes, accelerator.process_index
        prompts = [reply_prompts(batch) for batch in micro_batches]
        # A micro-batch's place in the step's batch: the loader deals them round the processes.
        seeds = [
            (self.seed, step, n * processes + me, sample)
            for n, these in enumerate(prompts) for sample in range(len(these))
        ]  # fmt: skip
        flat = [prompt for these in prompts for prompt in these]
        completions = self._sampled(model, flat, seeds, accelerator)
        batches, start = [], 0
        for batch, these in zip(micro_batches, prompts, strict=True):
            if not these:  # nothing trains in it either way
                batches.append(batch)
                continue
            rows = separate_rows(these, completions[start : start + len(these)], self.tokenizer.pad_token_id)
            start += len(these)
            rows["num_tokens"] = rows["attention_mask"].sum()
            batches.append({key: value.to(accelerator.device) for key, value in with_host_indices(rows).items()})
        return batches

    def _sampled(
        self, model: torch.nn.Module, prompts: list[list[int]], seeds: list[tuple[int, ...]], accelerator: Accelerator
    ) -> list[list[int]]:
        """Each prompt's completion, sampled with its seed's noise and cut where its row would pass data.max_length."""
        new_tokens = self.cfg.max_new_tokens
        sampling = Sampling(self.cfg.temperature, 1.0, row_noise(seeds, new_tokens))
        began = time.perf_counter()
        once = self.gather_once
        completions = sample_rollout(model, prompts, self.tokenizer, accelerator, new_tokens, sampling, once)
        completions = [c[: self.max_length - len(p)] for p, c in zip(prompts, completions, strict=True)]
        window = self.window
        window.seconds += time.perf_counter() - began
        window.completions += len(completions)
        window.tokens += sum(len(c) for c in completions)
        window.truncated += sum(cut_short(completions, stop_tokens(model, self.tokenizer)))
        return completions

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """The loss, divergence and cross-entropy per trained token of the held-out data (its replies, each sample
        counted once whatever the process count)."""
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        for batch in loader:
            losses = distill_losses(model, self.teacher_of(batch), batch, self.loss_path, self.spec)
            rows, width = batch["target_ids"].shape
            row_of = target_positions(batch).div(width, rounding_mode="floor")
            per_row = torch.zeros(rows, 3, device=row_of.device)
            values = torch.stack([losses.divergence, losses.cross_entropy, torch.ones_like(losses.divergence)], dim=1)
            per_row.index_add_(0, row_of, values)
            # Without the rows accelerate duplicated to give every process equal batches.
            (per_row,) = gather_rows(accelerator, (per_row,))
            sums += per_row.double().sum(dim=0).cpu()
        reshard(model)
        model.train()
        divergence, cross_entropy, tokens = sums.tolist()
        divergence, cross_entropy = divergence / max(tokens, 1), cross_entropy / max(tokens, 1)
        loss = divergence + self.cfg.sft_weight * cross_entropy
        return {"loss": loss, "divergence": divergence, "cross_entropy": cross_entropy}


class DistillBuilder:
    """Distillation as the build knows it (`finetune.objectives.ObjectiveBuilder`): sequences, and the teacher."""

    name = "distill"
    unit_noun = "sequences"
    reference_setting = "distill.teacher"

    def __init__(self, cfg: DistillConfig, data: DataConfig, student: ModelConfig):
        # The recipe refuses the student's own path; a copy of its weights under another path is found here.
        if same_weights(cfg.teacher, student.name_or_path):
            raise FinetuneError(
                f"distill.teacher {cfg.teacher!r} holds the same weights as the student {student.name_or_path!r} "
                "(a copy under another path): it would teach what the student already knows (every divergence 0); "
                "set distill.teacher to the larger model to learn from"
            )
        self.cfg = cfg
        self.data = data
        self.reference_model = cfg.teacher
        self.samples = NUMBERED_SEQUENCES if cfg.teacher_top_k is not None else SEQUENCES  # a table is by row

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        return None

    def build(self, context) -> tuple[Distill, Callable[[], None]]:
        accelerator = context.accelerator
        path = context.loss_path
        if self.cfg.teacher_top_k is not None:
            teacher = self._table(context)
        else:
            teacher = frozen_model(context.recipe.model, self.cfg.teacher, accelerator, "distill.teacher", "teacher")
        why = None
        if path == "chunked" and not isinstance(teacher, TeacherTable):
            why = chunked_loss_unsupported(accelerator.unwrap_model(teacher))
        if why is not None:
            path = "full_logits"
            accelerator.print(f"distill: both models' full logits, as the teacher's cannot be chunked: {why}")
        once = True
        if self.cfg.on_policy_fraction > 0:
            once, line = gathers_once(accelerator.unwrap_model(context.model), accelerator)
            accelerator.print(line)
        objective = Distill(
            self.cfg, path, teacher, context.tokenizer, context.recipe.train.seed, self.data.max_length, once
        )
        if self.cfg.estimator == "sampled":  # the student's own tokens: no cross-entropy to report
            objective.metric_names = ("divergence",)
        return objective, lambda: None

    def _table(self, context) -> TeacherTable:
        """The teacher's top-k table of these rows: read from beside them if this teacher computed it before, else
        computed here with the teacher loaded for it alone (collective). The table is keyed by the teacher's
        weights, so a hub teacher not downloaded yet is loaded first; one whose weights nothing identifies gets a
        table of this run's own."""
        recipe, accelerator, splits = context.recipe, context.accelerator, context.data.splits
        k = self.cfg.teacher_top_k
        numerics = f"{accelerator.mixed_precision}:{frozen_dtype(recipe.model, accelerator)}"  # the teacher's
        teacher = None
        if (fingerprint := base_fingerprint(self.cfg.teacher)) is None:
            teacher = self._teacher(context)  # downloads it: its weights are then there to identify the table
            fingerprint = base_fingerprint(self.cfg.teacher)
        output_dir = Path(recipe.output.dir)
        if fingerprint is None:
            key = table_key(UNCACHED, splits, numerics, k)
            folder = output_dir / f"teacher-top{k}-{key}"  # this run's: never read before it is computed
        else:
            key = table_key(fingerprint, splits, numerics, k)
            folder = table_folder(splits, key, k, output_dir)
            if (table := read_table(folder, key)) is not None:
                accelerator.print(
                    f"teacher: its top {k} tokens at {len(table.ids):,} trained positions, from {folder}"
                )
                return table
        teacher = teacher if teacher is not None else self._teacher(context)
        rows = recipe.train.micro_batch_size * MICRO_BATCHES_PER_FORWARD
        table = compute_table(teacher, splits, context.data.collate, accelerator, rows, k, folder, key)
        del teacher  # training holds none
        gc.collect()
        return table

    def _teacher(self, context) -> torch.nn.Module:
        return frozen_model(context.recipe.model, self.cfg.teacher, context.accelerator, "distill.teacher_top_k",
                            "teacher")  # fmt: skip
