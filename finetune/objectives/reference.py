"""The precomputed reference of a preference run: the initial weights' log-probabilities of every pair.

Before the first step the model is the reference, so its log-probabilities of each pair's chosen and
rejected replies are computed once, under no_grad and in eval mode (dropout off), sharded exactly as
training is (every process takes every world-size-th pair, all processes forward in lockstep, the
results are gathered), with the same packing. DPO then needs no second model in memory.

They are stored twice: beside the tokenized data in the `datasets` cache, under a key of the base's
weights fingerprint, the tokenized pairs (data, template, max_length) and the numerics, so that a rerun
reuses them and another base recomputes; and in the run's output folder, which a resumed run reads:
by then the weights have trained, so they can never be recomputed there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import torch
from accelerate import Accelerator
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from finetune.config import ModelConfig, PreferenceConfig
from finetune.engine.accelerator import compute_dtype
from finetune.engine.processes import equal_share
from finetune.engine.sequence import data_parallel_rank, data_parallel_size, sequence_parallel
from finetune.engine.wrap import reshard, shard_frozen
from finetune.errors import FinetuneError
from finetune.model.dropout import disable_dropout
from finetune.model.loading import DTYPES, base_fingerprint, load_model, model_folder
from finetune.model.routing import route_in_fp32
from finetune.model.weights import BaseSwitch
from finetune.objectives.loss import LossPath, sequence_logps
from finetune.storage.atomic import private_partial, publish_shared
from finetune.storage.fingerprint import sampled_fingerprint

if TYPE_CHECKING:
    from finetune.objectives import BuildContext

REFERENCE_FILE = "reference_logps.safetensors"


def reference_key(base_fingerprint: str | None, splits: list[datasets.Dataset], numerics: str) -> str:
    """What the reference's values depend on: the base's weights, the tokenized pairs, the compute precision."""
    parts = [base_fingerprint or "unknown", numerics, *(split._fingerprint for split in splits)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def read_reference(path: Path, key: str) -> torch.Tensor | None:
    """The table stored at `path` under `key`, or None if there is none (or it is for other data or weights)."""
    if not path.is_file():
        return None
    with safe_open(path, framework="pt") as f:
        if (f.metadata() or {}).get("key") != key:
            return None
        return f.get_tensor("logps")


def write_reference(path: Path, table: torch.Tensor, key: str) -> None:
    """Written whole and renamed into place: a reader never sees half a table, and runs writing the same table at
    once (a sweep) each write their own partial file."""
    partial = private_partial(path)
    save_file({"logps": table.contiguous()}, partial, metadata={"key": key})
    publish_shared(partial, path)


def cache_path(split: datasets.Dataset, key: str) -> Path | None:
    """Where the table lives beside the tokenized pairs in the `datasets` cache (None for in-memory data)."""
    files = split.cache_files
    return Path(files[0]["filename"]).parent / f"reference-{key}.safetensors" if files else None


def dealt_batches(
    split: datasets.Dataset,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    accelerator: Accelerator,
    rows: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """The split's rows this process forwards before training (a precomputation), `rows` at a time, on its device:
    every data-parallel-size-th row (a sequence group's processes take the same rows, each a slice of them), the
    last repeated so that every process runs as many forwards (each a collective under FSDP)."""
    mine, _ = equal_share(len(split), data_parallel_size(accelerator), data_parallel_rank(accelerator))
    for start in range(0, len(mine), rows):
        chosen = split.select(mine[start : start + rows]).to_list()
        yield {key: value.to(accelerator.device) for key, value in collate(chosen).items()}


def pair_columns(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss_path: LossPath) -> torch.Tensor:
    """(pairs, 2): a micro-batch of pairs' chosen and rejected log-probabilities (`compute_reference`'s default)."""
    logps = sequence_logps(model, batch, loss_path)
    pairs = batch["pair_index"].numel()
    return torch.stack([logps[:pairs], logps[pairs:]], dim=1)


@torch.no_grad()
def compute_reference(
    model: torch.nn.Module,
    splits: list[datasets.Dataset],
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    accelerator: Accelerator,
    micro_batch_size: int,
    loss_path: LossPath,
    columns: Callable[[torch.nn.Module, dict[str, torch.Tensor], LossPath], torch.Tensor] = pair_columns,
    noun: str = "pairs",
) -> torch.Tensor:
    """(samples, 2): each sample's log-probabilities under the model as it is, by `pair_index` (train and eval are
    numbered in one range), as `columns` takes them from a micro-batch: a pair's chosen and rejected sequence, or
    (KTO) a sample's own sequence and its mismatched one. A collective: every process calls it."""
    total = sum(len(split) for split in splits)
    table = torch.full((total, 2), float("nan"), dtype=torch.float64)
    sp = sequence_parallel(accelerator)
    model.eval()
    began = time.perf_counter()
    for split in splits:
        values, owners = [], []
        for batch in dealt_batches(split, collate, accelerator, micro_batch_size):  # a repeated sample: one value
            logps = columns(model, batch, loss_path)
            values.append((sp.sum(logps) if sp is not None else logps).double())
            owners.append(batch["pair_index"])
        if not values:
            continue
        gathered = accelerator.gather(torch.cat(values)).cpu()
        indices = accelerator.gather(torch.cat(owners)).cpu()
        table[indices] = gathered
    reshard(model)
    model.train()
    if torch.isnan(table).any():  # an invariant: every sample was computed by some process
        raise RuntimeError("the precomputed reference misses samples")
    accelerator.print(
        f"reference: log-probabilities of {total:,} {noun} precomputed with the initial weights in "
        f"{time.perf_counter() - began:.1f} s (preference.reference=precomputed)"
    )
    return table


def precomputed_reference(
    context: BuildContext,
    columns: Callable[[torch.nn.Module, dict[str, torch.Tensor], LossPath], torch.Tensor] = pair_columns,
    noun: str = "pairs",
) -> tuple[torch.Tensor, Callable[[], None]]:
    """The run's precomputed reference table (`compute_reference`), on the device, and what writes it into the output
    dir: read from there when resuming, from beside the tokenized data when this base and data computed it before,
    else computed now (a collective) and stored beside the data."""
    recipe, accelerator, data = context.recipe, context.accelerator, context.data
    numerics = f"{context.loss_path}:{accelerator.mixed_precision}:{recipe.model.dtype}:{recipe.data.packing}"
    key = reference_key(base_fingerprint(recipe.model.name_or_path), data.splits, numerics)
    output_file = Path(recipe.output.dir) / REFERENCE_FILE
    cached = cache_path(data.splits[0], key)
    if context.resume_from is not None:
        table = read_reference(output_file, key)
        folder = model_folder(recipe.model.name_or_path)
        if table is None and folder is not None:  # a run begun by an earlier version keyed it by sampled bytes
            table = read_reference(output_file, reference_key(sampled_fingerprint(folder), data.splits, numerics))
        table = check_resumable(table, Path(recipe.output.dir))
    elif cached is not None and (table := read_reference(cached, key)) is not None:
        accelerator.print(f"reference: log-probabilities of {len(table):,} {noun} read from {cached}")
    else:
        table = compute_reference(
            context.model, data.splits, data.collate, accelerator, recipe.train.micro_batch_size, context.loss_path,
            columns, noun,
        )  # fmt: skip
        if cached is not None and accelerator.is_main_process:
            write_reference(cached, table, key)
    # On the device, where the step looks samples up by their index without a copy back to the host.
    return table.to(accelerator.device), functools.partial(write_reference, output_file, table, key)


@dataclass(frozen=True)
class ChosenReference:
    """What a preference objective (DPO's family, KTO) compares against, as the recipe and the weights resolve it."""

    kind: str
    """precomputed, adapters, model or none (`PreferenceConfig.resolved_reference`)."""
    base_switch: BaseSwitch | None
    """What switches the policy's adapters off, where the weights have adapters."""
    model: torch.nn.Module | None = None
    """model: the frozen reference, sharded as the policy (`frozen_model`)."""
    logps: torch.Tensor | None = None
    """precomputed: the table (`precomputed_reference`), on the device."""
    write: Callable[[], None] = lambda: None
    """What writes the precomputed table into the output dir (main process); nothing otherwise."""


def chosen_reference(
    cfg: PreferenceConfig,
    context: BuildContext,
    columns: Callable[[torch.nn.Module, dict[str, torch.Tensor], LossPath], torch.Tensor] = pair_columns,
    noun: str = "pairs",
) -> ChosenReference:
    """The run's reference, loaded or computed (a collective where it is precomputed): `columns` and `noun` as for
    `compute_reference`."""
    switch = context.weights.base_switch()
    kind = cfg.resolved_reference(base_switch=switch is not None)
    if kind == "model":
        setting = "preference.reference=model"
        model = frozen_model(context.recipe.model, cfg.reference_model, context.accelerator, setting)
        return ChosenReference(kind, switch, model=model)
    if kind == "precomputed":
        logps, write = precomputed_reference(context, columns, noun)
        return ChosenReference(kind, switch, logps=logps, write=write)
    return ChosenReference(kind, switch)


def check_resumable(table: torch.Tensor | None, output_dir: Path) -> torch.Tensor:
    if table is None:
        raise FinetuneError(
            f"this preference run resumes from a checkpoint, but {output_dir / REFERENCE_FILE} (the reference "
            "log-probabilities computed with the initial weights) is missing or was computed for other data or "
            "another base; it cannot be recomputed from trained weights: restore it, or start a new run"
        )
    return table


def frozen_model(
    model: ModelConfig,
    name_or_path: str,
    accelerator: Accelerator,
    setting: str,
    role: str = "reference",
    score_pad_id: int | None = None,
) -> torch.nn.Module:
    """A second model to compare with or learn from (`setting` names what asked for it and `role` what it is, for
    the log): loaded as the policy's config says (its dtype and attention), frozen, without dropout, in eval mode,
    routing as the policy does, and sharded with the policy's per-layer units, so a forward gathers one layer at a
    time. Sharded by FSDP2, it is loaded in the run's compute precision: it never takes an optimizer step, and
    FSDP2's mixed precision casts every parameter to that precision for each forward anyway, so float32 weights
    would only double its memory for the same values (unsharded, autocast keeps some of its work in float32)."""
    name = frozen_dtype(model, accelerator)
    cfg = dataclasses.replace(model, name_or_path=name_or_path, config_file=None, dtype=name)
    reference = load_model(cfg, "none", score_pad_id=score_pad_id)  # with score_pad_id: a reward model
    reference.requires_grad_(False)
    disable_dropout(reference)
    route_in_fp32(reference)  # as the policy routes (a dense model has no routers)
    reference.eval()
    mesh = getattr(accelerator, "torch_device_mesh", None)  # hybrid sharding's 2-D mesh; None: the whole world
    fsdp_mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None
    shard_frozen(reference, getattr(accelerator.state, "fsdp_plugin", None), accelerator.device, fsdp_mesh)
    accelerator.print(
        f"{role}: {name_or_path}, frozen, sharded as the policy{_mesh_shape(reference)} ({setting}), in {name}"
    )
    return reference


def frozen_dtype(model: ModelConfig, accelerator: Accelerator) -> str:
    """The dtype a frozen model loads in (`frozen_model`): the compute precision where FSDP2 shards it, else the
    model's."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    dtype = DTYPES[model.dtype]
    if plugin is not None and plugin.fsdp_version == 2:
        dtype = compute_dtype(accelerator.mixed_precision, dtype)
    return next(name for name, value in DTYPES.items() if value == dtype)


def _mesh_shape(model: torch.nn.Module) -> str:
    """' over a 2 x 2 mesh': the device mesh a sharded model's parameters live on, for the log ('' unsharded)."""
    parameter = next(model.parameters())
    if not isinstance(parameter, DTensor):
        return ""
    return " over a " + " x ".join(map(str, parameter.device_mesh.shape)) + " mesh"
