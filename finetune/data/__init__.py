"""Datasets -> tokenized samples with loss targets -> packed or padded batches.

One module per stage, in the order the data flows: `sources` (files or hub), `chat` (conversations
rendered by the chat template), `tokenize` (every format -> input and target ids), `pack` (rows and
batches); this module runs them for a recipe and builds the loaders. Beside them, the samples of the other
objectives: `preference` (pairs), `prompts` and `prompt_only` (prompts answered by generation: evaluation,
online RL) and `rollout` (the rows a rollout trains on, a prompt once for its completions).

Every sample becomes `input_ids` plus `target_ids`, where `target_ids[i]` is the token the model
must predict after `input_ids[i]`, or IGNORE where no loss is taken. Shifting inside each sample
(rather than inside the model) means a packed row never asks one sample to predict the next.

May import: `engine`, `config`, `errors`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import datasets
import numpy
import pyarrow.compute
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig, GenerateConfig, SourceConfig
from finetune.data.chat import encode_chats
from finetune.data.pack import WINDOW, collate_packed, collate_padded, pack
from finetune.data.preference import PairStats
from finetune.data.prompts import Prompt, generation_prompts
from finetune.data.sources import (
    check_sources,
    hold_out,
    load_source,
    load_split,
    numbered,
    source_name,
    take_fraction,
)
from finetune.data.tokenize import IGNORE, check_invalid_share, detect_format, tokenize
from finetune.engine.batch import Batch
from finetune.engine.processes import main_process_first
from finetune.engine.quiet import no_datasets_bars
from finetune.engine.sequence import data_parallel_size
from finetune.errors import FinetuneError

__all__ = [
    "IGNORE", "Data", "DataStats", "build_data", "check_sources", "collate_packed", "collate_padded",
    "detect_format", "encode_chats", "load_split", "pack", "prepare_split", "tokenize",
]  # fmt: skip


@dataclass(frozen=True)
class DataStats:
    """What tokenization did to one split (or one source of it); logged so that nothing is dropped silently."""

    num_samples: int
    num_truncated: int
    num_dropped: int
    """Samples left with no target token (those dropped as too long are counted in `num_truncated` instead)."""
    num_tokens: int
    num_target_tokens: int
    num_rows: int
    num_expanded: int = 0
    """Samples that are one reply of a conversation expanded per turn (data.multi_turn=per_turn)."""
    num_reasoning_tokens: int = 0
    reasoning_trained: bool = True
    row_length: int = 0
    """Tokens per packed row (0: not packed), for the rows' fill: real tokens / row slots."""
    long_dropped: bool = False
    """data.truncation=drop: `num_truncated` samples were left out, not cut."""
    num_invalid: int = 0
    """data.invalid=drop: malformed samples left out."""
    invalid_examples: tuple[str, ...] = ()
    """The first of them, with their reasons, for the log."""
    sources: tuple[tuple[str, DataStats], ...] = ()
    """Per source of a mixture (`data.train`): its name and its own figures (rows: 0, rows are mixed)."""

    def describe(self, split: str) -> str:
        lines = [self._line(split)] + [f"  {source.path}{stats._line('')}" for source, stats in self.sources]
        return "\n".join(lines)

    def _line(self, split: str) -> str:
        expanded = f", {self.num_expanded:,} of them per-turn samples of expanded conversations" * bool(
            self.num_expanded
        )
        reasoning = ""
        if self.num_reasoning_tokens:
            trained = "trained" if self.reasoning_trained else "not trained"
            reasoning = f", {self.num_reasoning_tokens:,} of reasoning ({trained})"
        if self.num_invalid:
            reasoning += f", {self.num_invalid:,} invalid dropped (first: {' | '.join(self.invalid_examples)})"
        rows = f", {self.num_rows:,} rows" if self.num_rows else ""
        if self.num_rows and self.row_length:
            rows += f" filled to {100 * self.num_tokens / (self.num_rows * self.row_length):.1f}%"
        return (
            f"{split}: {self.num_samples:,} samples{expanded}, {self.num_tokens:,} tokens "
            f"({self.num_target_tokens:,} trained{reasoning}), {self.num_truncated:,} "
            f"{'dropped as longer than data.max_length' if self.long_dropped else 'truncated'}, "
            f"{self.num_dropped:,} dropped with no target token{rows}"
        )


def prepare_split(
    raw: datasets.Dataset | list[tuple[SourceConfig, datasets.Dataset]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    seed: int,
    evaluation: bool = False,
) -> tuple[datasets.Dataset, DataStats]:
    """Tokenize (each source of a mixture with its own format), drop samples left with nothing to
    train on, mix, and pack (after a seeded shuffle) if asked."""
    parts = raw if isinstance(raw, list) else [(None, raw)]
    tokenized = [
        (source, tokenize(dataset, tokenizer, cfg, source_name(source, cfg, evaluation))) for source, dataset in parts
    ]
    for source, part in tokenized if cfg.invalid == "drop" else ():
        check_invalid_share(part, source_name(source, cfg, evaluation) or "the data")
    every = tokenized[0][1] if len(tokenized) == 1 else datasets.concatenate_datasets([t for _, t in tokenized])
    with no_datasets_bars():
        kept = every.filter(lambda counts: [n > 0 for n in counts], input_columns="num_targets", batched=True)
    if len(kept) == 0:
        trained = "assistant turn" if "messages" in parts[0][1].column_names else "completion or text"
        raise FinetuneError(
            f"none of the {len(every):,} samples has a token to train on (no {trained} within data.max_length="
            f"{cfg.max_length} tokens); check the data, or raise data.max_length"
        )
    window = cfg.packing_window or WINDOW
    if cfg.packing_window is not None and cfg.packing_window > len(kept) and not evaluation:
        raise FinetuneError(
            f"data.packing_window={cfg.packing_window:,} is more than the {len(kept):,} training samples, so no "
            f"window of that size exists; set it to at most {len(kept):,}, or leave it out"
        )
    rows = pack(kept.shuffle(seed=seed), cfg.max_length, tokenizer.pad_token_id, window) if cfg.packing else kept
    per_source = tuple((source, _stats(t, cfg)) for source, t in tokenized) if len(tokenized) > 1 else ()
    row_length = cfg.max_length if cfg.packing else 0
    stats = dataclasses.replace(_stats(every, cfg), num_rows=len(rows), sources=per_source, row_length=row_length)
    return rows, stats


def eval_subset(
    parts: list[tuple[SourceConfig, datasets.Dataset]], samples: int, seed: int
) -> list[tuple[SourceConfig, datasets.Dataset]]:
    """`data.eval_samples`: a seeded subset of the eval data, each part (a held-out share of a source) keeping
    its share of it; the same on any process count and on resume (it depends on the data and the seed only)."""
    total = sum(len(dataset) for _, dataset in parts)
    if samples > total:
        raise FinetuneError(
            f"data.eval_samples={samples:,} is more than the {total:,} eval samples there are; lower it, or leave it "
            "out to evaluate on all of them"
        )
    generator = numpy.random.default_rng(seed)
    subset, given = [], 0
    for n, (source, dataset) in enumerate(parts):
        share = samples - given if n == len(parts) - 1 else round(samples * len(dataset) / total)
        given += share
        chosen = numpy.sort(generator.permutation(len(dataset))[:share])
        subset.append((source, dataset.select(chosen)))
    return subset


def _stats(tokenized: datasets.Dataset, cfg: DataConfig) -> DataStats:
    """Counted in Arrow, without turning every sample into Python lists."""
    table = tokenized.with_format("arrow")[:]
    num_targets = table["num_targets"].to_numpy()
    lengths = pyarrow.compute.list_value_length(table["input_ids"]).to_numpy()
    truncated = table["truncated"].to_numpy(zero_copy_only=False)
    dropped_long = cfg.truncation == "drop"
    reasons: list[str] = []
    invalid = numpy.zeros(len(tokenized), dtype=bool)
    if "invalid" in table.column_names:  # data.invalid=drop
        invalid = pyarrow.compute.not_equal(table["invalid"], "").to_numpy(zero_copy_only=False)
        reasons = table["invalid"].filter(pyarrow.compute.not_equal(table["invalid"], "")).to_pylist()
    return DataStats(
        num_samples=len(tokenized),
        num_truncated=int(truncated.sum()),
        num_dropped=int(((num_targets == 0) & ~(truncated & dropped_long) & ~invalid).sum()),
        long_dropped=dropped_long,
        num_invalid=int(invalid.sum()),
        invalid_examples=tuple(reasons[:3]),
        num_tokens=int(lengths[num_targets > 0].sum()),
        num_target_tokens=int(num_targets.sum()),
        num_rows=0,
        num_expanded=int(pyarrow.compute.sum(table["expanded"]).as_py() or 0),
        num_reasoning_tokens=int(pyarrow.compute.sum(table["num_reasoning"]).as_py() or 0),
        reasoning_trained=cfg.train_on_reasoning,
    )


class Samples(Protocol):
    """What an objective trains on, as `build_data` reads, tokenizes and batches it: sequences (`SEQUENCES`), or
    an objective's own (`finetune.data.preference.PAIR_SAMPLES`)."""

    numbered: bool
    """Whether train and eval samples are numbered in one range and kept (`Data.splits`): an objective looks
    something up by that number (a precomputed reference)."""

    def prepare(
        self,
        parts: list[tuple[SourceConfig, datasets.Dataset]],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        seed: int,
        evaluation: bool = False,
        first_index: int = 0,
    ) -> tuple[datasets.Dataset, Any]:
        """The rows of these sources, and their stats (with `describe(split)` for the log)."""
        ...

    def collate(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Callable[[list[dict]], dict]: ...


class Sequences:
    """Token sequences with their trained targets: chat, prompt/completion or text, packed or padded. Numbered, each
    row (packed or a sample) has a `row_index`, train and eval in one range, which its batches carry."""

    def __init__(self, numbered: bool = False):
        self.numbered = numbered

    def prepare(
        self,
        parts: list[tuple[SourceConfig, datasets.Dataset]],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        seed: int,
        evaluation: bool = False,
        first_index: int = 0,
    ) -> tuple[datasets.Dataset, DataStats]:
        rows, stats = prepare_split(parts, tokenizer, cfg, seed, evaluation=evaluation)
        if self.numbered:
            rows = rows.add_column("row_index", list(range(first_index, first_index + len(rows))))
        return rows, stats

    def collate(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Callable[[list[dict]], dict]:
        collate = collate_packed if cfg.packing else functools.partial(collate_padded, pad_id=tokenizer.pad_token_id)
        return functools.partial(_with_row_index, collate) if self.numbered else collate


def _with_row_index(collate: Callable[[list[dict]], Batch], rows: list[dict]) -> Batch:
    return collate(rows) | {"row_index": torch.tensor([row["row_index"] for row in rows])}


SEQUENCES = Sequences()
NUMBERED_SEQUENCES = Sequences(numbered=True)
"""Sequences whose rows something is looked up by (a distillation teacher's precomputed table)."""


@dataclass
class Data:
    train_loader: DataLoader
    eval_loader: DataLoader | None
    train_stats: DataStats | PairStats
    eval_stats: DataStats | PairStats | None
    splits: list[datasets.Dataset] = dataclasses.field(default_factory=list)
    """Numbered samples (preference pairs' `pair_index`, numbered sequences' `row_index`): the train and eval
    rows, in one range, for what is looked up by it (a precomputed reference or teacher)."""
    collate: Callable[[list[dict]], dict[str, torch.Tensor]] | None = None
    prompts: list[Prompt] = dataclasses.field(default_factory=list)
    """eval.generate: the held-out prompts the model answers at every evaluation (`finetune.rollouts.generation`)."""


def _then(collate: Callable[[list[dict]], Batch], split: Callable[[Batch], Batch]) -> Callable[[list[dict]], Batch]:
    return lambda rows: split(collate(rows))


def loader_options(device: torch.device) -> dict[str, Any]:
    """How batches reach a GPU without the step waiting for them: collated by a worker process while the GPU
    computes, in pinned host memory, so that the copy to the device is asynchronous (the accelerator copies
    with non_blocking). On CPU, collating in the training process costs less than a worker would."""
    if device.type != "cuda":
        return {}
    return {"num_workers": 1, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 4}


def build_data(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    accelerator: Accelerator,
    *,
    seed: int,
    micro_batch_size: int,
    samples: Samples | None = None,
    split: Callable[[Batch], Batch] | None = None,
    generate: GenerateConfig | None = None,
) -> Data:
    """Train and eval dataloaders (not yet prepared) of the objective's `samples` (sequences unless named), each
    batch cut to this process's slice by `split` under sequence parallelism. The main process tokenizes first;
    the others hit its cache."""
    samples = samples if samples is not None else SEQUENCES

    def load_and_prepare():
        train_raw = [(source, load_source(source)) for source in cfg.sources()]
        eval_raw = None
        if cfg.eval_path:
            eval_raw = [(SourceConfig(path=cfg.eval_path), numbered(load_split(cfg.eval_path, cfg.eval_split)))]
        elif cfg.eval_fraction > 0:
            eval_raw = []
            for i, (source, dataset) in enumerate(train_raw):  # the same fraction of every source
                train_part, held_out = hold_out(dataset, cfg.eval_fraction, seed, source_name(source, cfg))
                train_raw[i] = (source, train_part)
                eval_raw.append((source, held_out))
        train_raw = [(source, take_fraction(dataset, source, seed)) for source, dataset in train_raw]
        if eval_raw and cfg.eval_samples is not None:
            eval_raw = eval_subset(eval_raw, cfg.eval_samples, seed)
        train = samples.prepare(train_raw, tokenizer, cfg, seed)
        if not eval_raw:
            return train, (None, None), []
        prompts = generation_prompts([d for _, d in eval_raw], tokenizer, cfg, generate) if generate else []
        evaluation = samples.prepare(eval_raw, tokenizer, cfg, seed, evaluation=True, first_index=len(train[0]))
        return train, evaluation, prompts

    (train_rows, train_stats), (eval_rows, eval_stats), prompts = main_process_first(accelerator, load_and_prepare)
    needed = micro_batch_size * data_parallel_size(accelerator)
    if len(train_rows) < needed:
        held_out = ""
        if not cfg.eval_path and cfg.eval_fraction > 0:
            held_out = (
                f" (after data.eval_fraction={cfg.eval_fraction:g} held out that share for evaluation: lower it)"
            )
        raise FinetuneError(
            f"the training data yields {len(train_rows)} rows but one step needs micro_batch_size x processes = "
            f"{needed}{held_out}; add data or lower train.micro_batch_size"
        )
    collate = samples.collate(cfg, tokenizer)
    if split is not None:
        collate = _then(collate, split)
    feeding = loader_options(accelerator.device)
    train_loader = DataLoader(
        train_rows,
        batch_size=micro_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
        **feeding,
    )
    eval_loader = None
    if eval_rows is not None and len(eval_rows) > 0:
        eval_loader = DataLoader(eval_rows, batch_size=micro_batch_size, collate_fn=collate, **feeding)
    splits = [split for split in (train_rows, eval_rows) if split is not None] if samples.numbered else []
    return Data(train_loader, eval_loader, train_stats, eval_stats, splits, collate, prompts)
