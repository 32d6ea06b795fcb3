"""Sequence parallelism: each row split over a group of processes, attention whole by exchanging heads.

`parallelism_config_sp_size: N` in an FSDP2 accelerate config makes groups of N processes that share the same rows;
each process holds a contiguous slice of them (`split`). Everything a layer does token by token (norms, MLPs, the
loss) runs on the slice alone. Attention needs the whole row, so around it an all-to-all trades the sequence split
for a head split (DeepSpeed-Ulysses' layout): before it, a process holds every head of its slice; after, a
`heads / N` share of the heads over the whole row, attends with the row's samples intact (the varlen path with the
row's global `cu_seq_lens`, `finetune.engine.attention`), and a second all-to-all trades back. Position ids travel with
the slice, global to each sample, so RoPE rotates every token as if the row were whole; a sample that crosses a
slice boundary is exact. Activation memory per process falls to about 1/N; attention's all-to-all moves
4 x (tokens / N) x hidden values per layer.

Why by hand: accelerate's `sp_size` runs DeepSpeed's engine only, and its `cp_size` runs torch's ring attention,
which replaces each layer's mask with `is_causal` (packed rows would attend across their samples), refuses sliding
windows, and has no CPU kernel. The all-to-all here is attention-agnostic and runs over gloo: the same code is
proven on CPU and run on GPUs.

Layout: the mesh is accelerate's own (`dp_replicate`, `dp_shard`, `cp`) with the sequence group in the `cp`
dimension, innermost (consecutive ranks, one machine's fast links). Under that name accelerate's data loader gives
every process of a group the same rows, and FSDP2 shards the parameters over `dp_shard_cp`, every data x sequence
process. The parallelism config accelerate keeps says `cp_size=1`, so it attaches none of its ring-attention hooks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator

from finetune.engine.attention import cumulative_lengths
from finetune.engine.batch import IGNORE, Batch, kept_positions
from finetune.errors import FinetuneError

MESH_DIM = "cp"
"""The sequence group's dimension in accelerate's mesh (see the module's docstring for why this name)."""


T = TypeVar("T", bound=tuple[torch.Tensor, ...])


def launched_size(environ: Mapping[str, str] = os.environ) -> int:
    """The sequence-parallel degree of the launch this process was started by (1: none), from accelerate's
    environment."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    size = environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")
    if not size.isdigit() or int(size) < 1:
        raise FinetuneError(
            f"parallelism_config_sp_size={size}: it is the number of processes each row is split over, a whole "
            "number >= 1 (1: no sequence parallelism); fix the accelerate config"
        )
    return int(size)


def model_problems(config: Any, size: int) -> list[str]:
    """What keeps a model of this config from splitting its rows over sequence groups of `size`."""
    if size == 1:
        return []
    problems = []
    text = config.get_text_config()
    heads = text.num_attention_heads
    if heads % size:
        problems.append(
            f"sequence parallelism gives each of its {size} processes a share of the {heads} attention heads, which "
            f"{size} does not divide; set parallelism_config_sp_size to a divisor of {heads}"
        )
    return problems


@dataclass(frozen=True)
class SequenceParallel:
    """This process's place in its sequence group."""

    size: int
    rank: int
    group: dist.ProcessGroup

    def split(self, batch: Batch) -> Batch:
        """This process's slice of a collated batch (on the host, as it is collated). See `split_batch`."""
        return split_batch(batch, self.size, self.rank)

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums over the group's slices (differentiable): each process's share added up."""
        return sum_over_group(partial, self.group)

    @property
    def share(self) -> float:
        """What this process counts of a value every process of the group computed alike (a pair's loss from the
        group's summed log-probabilities): all of it on the group's first process, none on the others, so that
        summed over processes it counts once (the gradient still reaches every slice, through `sum`)."""
        return 1.0 if self.rank == 0 else 0.0


def sequence_parallel(accelerator: Accelerator) -> SequenceParallel | None:
    """This process's sequence group, when the launch has them (`finetune.engine.accelerator` attached the mesh)."""
    mesh = accelerator.torch_device_mesh
    if mesh is None or MESH_DIM not in (mesh.mesh_dim_names or ()):
        return None
    group = mesh[MESH_DIM]
    return SequenceParallel(group.size(), group.get_local_rank(), group.get_group())


def data_parallel_size(accelerator: Accelerator) -> int:
    """Processes that train on rows of their own: the processes, less the sequence groups' sharing."""
    sp = sequence_parallel(accelerator)
    return accelerator.num_processes // (sp.size if sp is not None else 1)


def data_parallel_rank(accelerator: Accelerator) -> int:
    """This process's place among the `data_parallel_size` ones (a sequence group's processes share it)."""
    sp = sequence_parallel(accelerator)
    return accelerator.process_index // (sp.size if sp is not None else 1)


def gather_rows(accelerator: Accelerator, sums: T) -> T:
    """accelerate's `gather_for_metrics` of per-row sums (one value per row of this process's micro-batch): every
    row once, the rows accelerate repeated to even out the last batch dropped. Under sequence parallelism each
    process holds a slice's share of its rows' sums: the group adds them up, and one process of each group gives
    the rows (accelerate's would count each row once per process of the group, and cut the repeats by row count)."""
    sp = sequence_parallel(accelerator)
    if sp is None:
        return accelerator.gather_for_metrics(sums)
    gathered = []
    for values in sums:
        values = values.clone()
        dist.all_reduce(values, group=sp.group)
        every = accelerator.gather(values).unflatten(0, (accelerator.num_processes, -1))[:: sp.size].flatten(0, 1)
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            every = every[: state.remainder]
        gathered.append(every)
    return tuple(gathered)  # type: ignore[return-value]


def sum_over_group(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `tensor` over the group's processes, differentiable: each process's gradient is the sum of every
    process's gradient of the sum (torch's differentiable all-reduce is deprecated; its replacement has no
    backward)."""
    return _SumOverGroup.apply(tensor, group)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


_PADDING = {"input_ids": 0, "target_ids": IGNORE, "sequence_ids": -1}
"""The per-position fields of a batch that are sliced, with what pads a row to a length the group divides."""
_WHOLE = ("pair_index", "sequence_targets")
"""Preference pairs' per-pair and per-sequence fields, which every slice carries whole."""


def split_batch(batch: Batch, size: int, rank: int) -> Batch:
    """Slice `rank` of `size` of a batch of rows (sequences, or preference pairs' sequences): every row cut into
    `size` contiguous pieces.

    Slices keep their global `position_ids` (padded rows get theirs here: the model would count each slice from
    0), and packed rows keep the whole rows' `cu_seq_lens`, which the attention reads once the exchange made the
    rows whole. A row length `size` does not divide is padded at the end with positions no target reads (in
    packed rows a sample of its own). `num_tokens` and `kept_index` become the slice's, so that summed over the
    group every token counts once.
    """
    packed = "attention_mask" not in batch
    rows, length = batch["input_ids"].shape
    if packed:
        positions = batch["position_ids"]
        real = torch.arange(length).expand(rows, length) < batch["row_tokens"].reshape(-1, 1)
    else:
        positions = torch.arange(length).expand(rows, length)
        real = batch["attention_mask"].bool()
    whole = {key: batch[key] for key in _PADDING if key in batch} | {"position_ids": positions, "real": real}
    padding = -length % size
    if padding:
        fill = {key: torch.full((rows, padding), value) for key, value in _PADDING.items()} | {
            "position_ids": torch.arange(padding).expand(rows, padding) + (0 if packed else length),
            "real": torch.zeros(rows, padding, dtype=torch.bool),
        }
        whole = {key: torch.cat([value, fill[key].to(value.dtype)], dim=1) for key, value in whole.items()}
    piece = (length + padding) // size
    part = {key: value[:, rank * piece : (rank + 1) * piece].contiguous() for key, value in whole.items()}
    real = part.pop("real")
    if packed:
        part["cu_seq_lens"] = cumulative_lengths(whole["position_ids"])
        # A row's real tokens come first, so a slice's do too (what a mixture of experts' balancing reads).
        part["row_tokens"] = (batch["row_tokens"] - rank * piece).clamp(0, piece)
    else:
        part["attention_mask"] = real.long()
    part["num_tokens"] = real.sum()
    part["kept_index"] = kept_positions(part["target_ids"])
    for key in _WHOLE:  # per sequence or pair, not per position
        if key in batch:
            part[key] = batch[key]
    return part  # type: ignore[return-value]
