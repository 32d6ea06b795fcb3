"""Tokenized samples -> rows: packed to exactly `max_length` tokens, or padded per batch."""

from __future__ import annotations

import functools
from typing import Any

import datasets
import torch

from finetune.data.tokenize import IGNORE


def pack(dataset: datasets.Dataset, max_length: int, pad_id: int) -> datasets.Dataset:
    """Greedily concatenate samples into rows of exactly `max_length` tokens.

    `position_ids` restart at 0 for each sample; transformers reads those restarts as sequence
    boundaries and builds a block-causal mask, so attention does not cross samples either.
    """
    return dataset.map(
        functools.partial(_pack_batch, max_length=max_length, pad_id=pad_id),
        batched=True,
        batch_size=2000,
        remove_columns=dataset.column_names,
        desc="packing",
    )


def _pack_batch(batch: dict[str, list], *, max_length: int, pad_id: int) -> dict[str, list]:
    rows: dict[str, list] = {"input_ids": [], "target_ids": [], "position_ids": [], "num_tokens": []}
    ids: list[int] = []
    targets: list[int] = []
    positions: list[int] = []

    def flush() -> None:
        padding = max_length - len(ids)
        rows["input_ids"].append(ids + [pad_id] * padding)
        rows["target_ids"].append(targets + [IGNORE] * padding)
        rows["position_ids"].append(positions + list(range(padding)))
        rows["num_tokens"].append(len(ids))

    for sample_ids, sample_targets in zip(batch["input_ids"], batch["target_ids"], strict=True):
        if len(ids) + len(sample_ids) > max_length:
            flush()
            ids, targets, positions = [], [], []
        ids.extend(sample_ids)
        targets.extend(sample_targets)
        positions.extend(range(len(sample_ids)))
    if ids:
        flush()
    return rows


def collate_packed(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "target_ids", "position_ids")}
    batch["num_tokens"] = torch.tensor(sum(row["num_tokens"] for row in rows))
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
    return tensors
