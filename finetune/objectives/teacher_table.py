"""The teacher's top-k table of an off-policy distillation (`distill.teacher_top_k`): computed once, read every step.

Off-policy, the teacher only ever sees the data's rows, so what it says of them can be computed before the first
step: at every trained position of every row (train and eval, numbered in one range: `row_index`), its k most
likely next tokens and their log-probabilities (over the whole vocabulary, at temperature 1). Training then holds
no teacher: each micro-batch looks its rows up, and the divergence is taken over those k tokens, both the
teacher's and the student's distributions renormalized on them (`finetune.objectives.divergence`; with k the
vocabulary's size, the live teacher's divergence exactly).

The table is computed as a DPO reference is (`finetune.objectives.reference`): every process takes every world-size-th
row, all forward in lockstep with the teacher sharded per layer, and the results are gathered. It can be far larger
than memory (trained tokens x k x 8 bytes), so it is written as it comes, by each node's first process, into two
memory-mapped arrays in a folder beside the tokenized data, named by a key of the teacher's weights, the rows
(data, template, max_length, packing), the numerics and k, and renamed into place whole: a rerun with the same
key reads it, anything else computes its own, and a reader never sees half a table. A resumed run reads it too:
the teacher is frozen, so a lost table is simply computed again.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy
import pyarrow.compute
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from finetune.engine.batch import IGNORE
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError
from finetune.objectives.divergence import TopK, head_inputs
from finetune.objectives.loss import model_inputs, output_head, target_positions
from finetune.objectives.reference import dealt_batches
from finetune.storage.atomic import private_partial, publish_shared

META = "table.json"
UNCACHED = "uncached"
"""The key's teacher part where no fingerprint identifies its weights: such a table is computed into the run's own
output folder and never read by another run."""
CHUNK_ROWS = 1024
"""Positions whose logits exist at once while the top k is taken (a (rows, vocab) fp32 tensor)."""
MICRO_BATCHES_PER_FORWARD = 4
"""The table's forwards take this many training micro-batches' rows at once: they keep no activations for a
backward (a layer's at a time) and no gradients, so 4 fit where one trains, and each forward costs less per row."""


@dataclass(frozen=True)
class TeacherTable:
    ids: numpy.ndarray
    """(trained tokens, k) int32, memory-mapped: row r's tokens are rows offsets[r]:offsets[r + 1]."""
    logps: numpy.ndarray
    """(trained tokens, k) float32, memory-mapped."""
    offsets: numpy.ndarray
    """(rows + 1,) int64: where each row's trained tokens start."""

    def lookup(self, row_index: torch.Tensor, device: torch.device) -> TopK:
        """The batch's trained tokens' entries, for the rows of a batch (its `row_index`), in their order."""
        at = _positions(self.offsets, row_index.cpu().numpy())
        ids = torch.from_numpy(numpy.ascontiguousarray(self.ids[at])).to(device, torch.long)
        return TopK(ids, torch.from_numpy(numpy.ascontiguousarray(self.logps[at])).to(device))


def _positions(offsets: numpy.ndarray, rows: numpy.ndarray) -> numpy.ndarray:
    """The table rows of these data rows' trained tokens, row after row."""
    spans = [numpy.arange(offsets[r], offsets[r + 1]) for r in rows]
    return numpy.concatenate(spans) if spans else numpy.zeros(0, dtype=numpy.int64)


def table_key(teacher_fingerprint: str, splits: list[datasets.Dataset], numerics: str, k: int) -> str:
    """What the table's values depend on: the teacher's weights (their fingerprint; `UNCACHED` where nothing
    identifies them, for a table no other run reads), the rows, the compute precision, k."""
    parts = [teacher_fingerprint, numerics, str(k), *(split._fingerprint for split in splits)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def table_folder(splits: list[datasets.Dataset], key: str, k: int, output_dir: Path) -> Path:
    """Beside the tokenized rows in the `datasets` cache; in the run's output folder for data held in memory."""
    files = splits[0].cache_files
    return (Path(files[0]["filename"]).parent if files else output_dir) / f"teacher-top{k}-{key}"


def trained_offsets(splits: list[datasets.Dataset]) -> numpy.ndarray:
    """(rows + 1,) where each row's trained tokens start in the table, the splits' rows numbered in one range.
    Counted in Arrow, a thousand rows at a time."""
    counts = []
    for split in splits:
        for part in split.with_format("arrow").iter(batch_size=1000):
            trained = pyarrow.compute.not_equal(pyarrow.compute.list_flatten(part["target_ids"]), IGNORE)
            lengths = pyarrow.compute.list_value_length(part["target_ids"]).to_numpy()
            flags = trained.to_numpy(zero_copy_only=False).astype(numpy.int64)
            ends = numpy.cumsum(lengths)
            counts.append(numpy.add.reduceat(flags, ends - lengths) * (lengths > 0) if len(flags) else lengths * 0)
    return numpy.concatenate([[0], numpy.cumsum(numpy.concatenate(counts))]).astype(numpy.int64)


def read_table(folder: Path, key: str) -> TeacherTable | None:
    """The table in `folder`, or None if there is none there (or it was computed under another key)."""
    meta = folder / META
    if not meta.is_file() or json.loads(meta.read_text()).get("key") != key:
        return None
    ids = numpy.load(folder / "ids.npy", mmap_mode="r")
    return TeacherTable(ids, numpy.load(folder / "logps.npy", mmap_mode="r"), numpy.load(folder / "offsets.npy"))


@torch.no_grad()
def compute_table(
    teacher: torch.nn.Module,
    splits: list[datasets.Dataset],
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    accelerator: Accelerator,
    rows_per_forward: int,
    k: int,
    folder: Path,
    key: str,
) -> TeacherTable:
    """The teacher's top k at every trained position of the splits' rows, written to `folder` and read back from it.
    A collective: every process calls it."""
    vocab = output_head(teacher).weight.shape[0]
    if k > vocab:
        raise FinetuneError(
            f"distill.teacher_top_k={k} is more than the teacher's {vocab:,} tokens; set it to at most {vocab:,} "
            "(the whole vocabulary: the live teacher's divergence exactly)"
        )
    offsets = trained_offsets(splits)
    writer = _Writer(folder, int(offsets[-1]), k) if accelerator.is_local_main_process else None
    began = time.perf_counter()
    for split in splits:
        for batch in dealt_batches(split, collate, accelerator, rows_per_forward):  # a repeated row: one value
            top = teacher_top_k(teacher, batch, k)
            at = torch.from_numpy(_positions(offsets, batch["row_index"].cpu().numpy())).to(accelerator.device)
            parts = [accelerator.pad_across_processes(t, dim=0, pad_index=-1) for t in (at, top.ids, top.logps)]
            at, ids, logps = (accelerator.gather(t).cpu() for t in parts)
            if writer is not None:
                writer.write(at.numpy(), ids.numpy(), logps.numpy())
    reshard(teacher)
    if writer is not None:
        writer.close(offsets, key)
    accelerator.wait_for_everyone()
    accelerator.print(
        f"teacher: its top {k} tokens at {int(offsets[-1]):,} trained positions of {len(offsets) - 1:,} rows "
        f"computed in {time.perf_counter() - began:.1f} s, into {folder} (distill.teacher_top_k)"
    )
    table = read_table(folder, key)
    if table is None:  # an invariant: the writer renamed it into place before the barrier
        raise RuntimeError(f"the teacher's table is missing from {folder}")
    return table


@torch.no_grad()
def teacher_top_k(teacher: torch.nn.Module, batch: dict[str, torch.Tensor], k: int) -> TopK:
    """The teacher's k most likely next tokens and their log-probabilities at the batch's trained positions; its
    logits exist CHUNK_ROWS positions at a time."""
    with head_inputs(output_head(teacher), target_positions(batch)) as captured:
        teacher(**model_inputs(teacher, batch), use_cache=False, logits_to_keep=0)
    hidden, weight, bias = captured
    ids, logps = [], []
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        logits = F.linear(hidden[start : start + CHUNK_ROWS], weight, bias).float()
        values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(indices.int())
        logps.append(values)
    if not ids:
        return TopK(torch.zeros(0, k, dtype=torch.int32, device=hidden.device), hidden.new_zeros(0, k).float())
    return TopK(torch.cat(ids), torch.cat(logps))


class _Writer:
    """One node's copy of the table, filled as the gathered rows come and renamed into place whole."""

    def __init__(self, folder: Path, tokens: int, k: int):
        self.folder = folder
        self.partial = private_partial(folder)  # a sweep's runs may compute the same table at once
        self.partial.mkdir(parents=True)
        self.ids = numpy.lib.format.open_memmap(self.partial / "ids.npy", "w+", numpy.int32, (tokens, k))
        self.logps = numpy.lib.format.open_memmap(self.partial / "logps.npy", "w+", numpy.float32, (tokens, k))

    def write(self, at: numpy.ndarray, ids: numpy.ndarray, logps: numpy.ndarray) -> None:
        kept = at >= 0  # the padding of a process with fewer positions
        self.ids[at[kept]] = ids[kept]
        self.logps[at[kept]] = logps[kept]

    def close(self, offsets: numpy.ndarray, key: str) -> None:
        self.ids.flush()
        self.logps.flush()
        numpy.save(self.partial / "offsets.npy", offsets)
        meta = {"key": key, "k": int(self.ids.shape[1]), "rows": len(offsets) - 1, "tokens": int(offsets[-1])}
        (self.partial / META).write_text(json.dumps(meta))  # last: a folder without it is never read
        # The name holds the key: a table already there (another run's, another node's on a shared file system)
        # is this one, and stays, read by whoever renamed it.
        publish_shared(self.partial, self.folder)
