"""Tokenized samples -> rows: packed to exactly `max_length` tokens, or padded per batch."""

from __future__ import annotations

import bisect
import functools
from typing import Any

import datasets
import torch

from finetune.engine.attention import cumulative_lengths
from finetune.engine.batch import IGNORE, Batch, kept_positions
from finetune.engine.quiet import no_datasets_bars

WINDOW = 2000
"""Samples packed together: each window of the (seeded, shuffled) data is packed on its own, so packing is
the same on any process count and costs no pass over the whole data; 2,000 samples give the best fit
enough choice to fill rows to about 98% on chat-like lengths (`make bench`, row "packing")."""


def pack(dataset: datasets.Dataset, max_length: int, pad_id: int, window: int = WINDOW) -> datasets.Dataset:
    """Concatenate samples into rows of exactly `max_length` tokens, best-fit decreasing within each window:
    the longest samples are placed first, each into the row it leaves the least room in (a new row when none
    has room), so short samples fill the gaps the long ones leave. Deterministic for a given order.

    `position_ids` restart at 0 for each sample; transformers reads those restarts as sequence
    boundaries and builds a block-causal mask, so attention does not cross samples either.
    """
    with no_datasets_bars():
        return dataset.map(
            functools.partial(_pack_batch, max_length=max_length, pad_id=pad_id),
            batched=True,
            batch_size=window,
            remove_columns=dataset.column_names,
            desc="packing",
        )


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """The samples (by index into `lengths`, each at most `capacity`) of each row, best-fit decreasing."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: the tightest row with room is found by bisection
    for n in sorted(range(len(lengths)), key=lambda n: -lengths[n]):  # stable: equal lengths keep their order
        at = bisect.bisect_left(free, (lengths[n], -1))
        if at == len(free):
            rows.append([n])
            bisect.insort(free, (capacity - lengths[n], len(rows) - 1))
        else:
            room, row = free.pop(at)
            rows[row].append(n)
            bisect.insort(free, (room - lengths[n], row))
    return rows


def balanced_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """The sequences (by index into `lengths`, each at most `capacity`) of each row of one micro-batch, for the fewest
    token slots: the batch is as wide as its longest row. For a few row counts from the fewest the total allows, each
    sequence (longest first) goes into the emptiest row, a new row only where none holds it; the layout of fewest
    slots wins. Best fit fills every row but the last, which a micro-batch of a few rows pads to `capacity`."""
    order = sorted(range(len(lengths)), key=lambda n: -lengths[n])
    fewest = -(-sum(lengths) // capacity)
    layouts = [_spread(lengths, order, capacity, count) for count in range(fewest, fewest + 3)]
    return min(layouts, key=lambda rows: len(rows) * max(sum(lengths[n] for n in row) for row in rows))


def _spread(lengths: list[int], order: list[int], capacity: int, count: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(count)]
    used = [0] * count
    for n in order:
        emptiest = min(range(len(rows)), key=used.__getitem__)
        if used[emptiest] + lengths[n] > capacity:  # then no row holds it
            rows.append([])
            used.append(0)
            emptiest = len(rows) - 1
        rows[emptiest].append(n)
        used[emptiest] += lengths[n]
    return [row for row in rows if row]


def next_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """The packing finetune used before best fit, kept as the baseline `make bench` and the tests measure it
    against: samples in their order, a row closed as soon as the next sample does not fit."""
    rows: list[list[int]] = [[]]
    used = 0
    for n, length in enumerate(lengths):
        if used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(n)
        used += length
    return rows


def _pack_batch(batch: dict[str, list], *, max_length: int, pad_id: int) -> dict[str, list]:
    rows: dict[str, list] = {"input_ids": [], "target_ids": [], "position_ids": [], "num_tokens": []}
    samples_ids, samples_targets = batch["input_ids"], batch["target_ids"]
    for members in best_fit([len(ids) for ids in samples_ids], max_length):
        ids: list[int] = []
        targets: list[int] = []
        positions: list[int] = []
        for n in members:
            ids.extend(samples_ids[n])
            targets.extend(samples_targets[n])
            positions.extend(range(len(samples_ids[n])))
        padding = max_length - len(ids)
        rows["input_ids"].append(ids + [pad_id] * padding)
        rows["target_ids"].append(targets + [IGNORE] * padding)
        rows["position_ids"].append(positions + list(range(padding)))
        rows["num_tokens"].append(len(ids))
    return rows


def collate_packed(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "target_ids", "position_ids")}
    # Real tokens per row (the rest is padding, which has no attention mask to tell it apart).
    batch["row_tokens"] = torch.tensor([row["num_tokens"] for row in rows])
    batch["num_tokens"] = batch["row_tokens"].sum()
    return with_host_indices(batch)


def with_host_indices(batch: Batch) -> Batch:
    """Add what the step would otherwise find on the device, where finding it (`nonzero`, boolean-mask indexing)
    stalls the host until the GPU catches up: `kept_index`, the positions with a target in the rows flattened
    (finetune.objectives.loss); for packed rows `cu_seq_lens`, where each sample starts in them and their end (the
    varlen path's boundaries, finetune.engine.attention). Computed here, on the host, as the batch is collated."""
    if "kept_index" not in batch:  # where a collator knows better (a position with several targets), its own
        batch["kept_index"] = kept_positions(batch["target_ids"])
    if "position_ids" in batch:
        batch["cu_seq_lens"] = cumulative_lengths(batch["position_ids"])
    return batch


def collate_padded(rows: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample in the batch."""
    length = max(len(row["input_ids"]) for row in rows)
    batch: dict[str, list] = {"input_ids": [], "target_ids": [], "attention_mask": []}
    for row in rows:
        padding = length - len(row["input_ids"])
        batch["input_ids"].append(row["input_ids"] + [pad_id] * padding)
        batch["target_ids"].append(row["target_ids"] + [IGNORE] * padding)
        batch["attention_mask"].append([1] * len(row["input_ids"]) + [0] * padding)
    tensors = {key: torch.tensor(value) for key, value in batch.items()}
    tensors["num_tokens"] = tensors["attention_mask"].sum()
    return with_host_indices(tensors)
