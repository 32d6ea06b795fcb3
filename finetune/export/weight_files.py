"""The weights of a checkpoint or a model folder, read a few tensors at a time: a SHARDED checkpoint (DCP files), a
FULL one (one torch file, memory-mapped), safetensors files (DDP and single-process checkpoints, a base model), and
an adapter checkpoint's adapter. The export and the merge both read through these; neither imports the other."""

from __future__ import annotations

import json
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from finetune.errors import FinetuneError, first_line
from finetune.storage.checkpoint import ADAPTER_RECORD, ADAPTER_STATE, MODEL_FILES, MetadataUnpickler

# Wrapper prefixes that FSDP1, activation checkpointing, torch.compile and DDP add to parameter names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def adapter_tensors(checkpoint: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter of an adapter checkpoint under PEFT's names, as trained (fp32) or in `dtype`. Only
    the adapter's tensors are read (a small fraction of the model), never the base's."""
    names: dict[str, str] = json.loads((checkpoint / MODEL_FILES / ADAPTER_RECORD).read_text())["names"]
    weights = ShardedWeights(checkpoint / ADAPTER_STATE)
    missing = [name for name in names if name not in weights.shapes]
    if missing:
        raise FinetuneError(
            f"checkpoint {checkpoint} lacks adapter tensors ({', '.join(missing[:3])}); export a checkpoint written "
            "by `finetune train`, unmodified"
        )
    stored = weights.dtypes
    tensors = {
        name: torch.empty(weights.shapes[name], dtype=target_dtype(stored[name], dtype or stored[name]))
        for name in names
    }
    read_checked(weights, tensors, checkpoint)
    return {names[name]: tensor for name, tensor in tensors.items()}


class CheckpointWeights(ABC):
    """The model weights of one checkpoint, by parameter name, readable a few tensors at a time."""

    def __init__(self, shapes: dict[str, torch.Size], dtypes: dict[str, torch.dtype]):
        self.shapes, self.dtypes = shapes, dtypes

    @abstractmethod
    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill each target (by checkpoint name) with that tensor's values, cast to the target's dtype."""

    def training_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the parameters: what the run trained in."""
        counts: Counter[torch.dtype] = Counter()
        for name, shape in self.shapes.items():
            if self.dtypes[name].is_floating_point:
                counts[self.dtypes[name]] += shape.numel()
        return counts.most_common(1)[0][0]


class ShardedWeights(CheckpointWeights):
    """A SHARDED checkpoint: torch.distributed.checkpoint files, one per saving rank."""

    def __init__(self, folder: Path):
        self.reader = _SafeMetadataReader(folder)
        metadata = self.reader.read_metadata().state_dict_metadata
        # accelerate saves {"model": model.state_dict()}, which DCP flattens to "model.<name>".
        # The model's tensors only: an adapter checkpoint keeps its optimizer state in the same folder.
        self.keys = {
            clean_name(key.removeprefix("model.")): key
            for key, item in metadata.items()
            if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
        }
        super().__init__(
            {name: metadata[key].size for name, key in self.keys.items()},
            {name: metadata[key].properties.dtype for name, key in self.keys.items()},
        )

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        # DCP copies each saved piece straight into its destination; only a target of another dtype
        # than the checkpoint's needs a buffer in the checkpoint's dtype, cast afterwards.
        buffers = {
            name: target if target.dtype == self.dtypes[name] else torch.empty_like(target, dtype=self.dtypes[name])
            for name, target in targets.items()
        }
        with warnings.catch_warnings():  # "torch.distributed is disabled": one process is the point here
            warnings.simplefilter("ignore", UserWarning)
            wanted = {self.keys[name]: buffer for name, buffer in buffers.items()}
            dcp.load(wanted, storage_reader=self.reader, no_dist=True)  # reads only these tensors' bytes
        for name, target in targets.items():
            if buffers[name] is not target:
                target.copy_(buffers[name])


class TorchFileWeights(CheckpointWeights):
    """A FULL checkpoint of an FSDP run: one torch.save file, memory-mapped so it is read lazily."""

    def __init__(self, path: Path):
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        self.tensors = {clean_name(key): tensor for key, tensor in loaded.items()}
        super().__init__(
            {name: t.shape for name, t in self.tensors.items()}, {name: t.dtype for name, t in self.tensors.items()}
        )

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        for name, target in targets.items():
            target.copy_(self.tensors[name])  # the file's pages are read here


class SafetensorsWeights(CheckpointWeights):
    """The full model as safetensors files (DDP and single-process checkpoints)."""

    def __init__(self, paths: list[Path]):
        self.files: dict[str, tuple[Path, str]] = {}
        shapes, dtypes = {}, {}
        for path in paths:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    view = f.get_slice(key)
                    name = clean_name(key)
                    self.files[name] = (path, key)
                    shapes[name] = torch.Size(view.get_shape())
                    dtypes[name] = _SAFETENSORS_DTYPES[view.get_dtype()]
        super().__init__(shapes, dtypes)

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        for name, target in targets.items():
            path, key = self.files[name]
            with safe_open(path, framework="pt") as f:
                target.copy_(f.get_tensor(key))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def open_weights(checkpoint: Path) -> CheckpointWeights:
    """The model weights of a checkpoint, in whichever layout accelerate's save_state wrote them."""
    if (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return ShardedWeights(checkpoint / "pytorch_model_fsdp_0")
    full = sorted(checkpoint.glob("pytorch_model_fsdp*.bin"))
    if full:
        return TorchFileWeights(full[0])
    safetensors_files = sorted(checkpoint.glob("model*.safetensors"))
    if safetensors_files:
        return SafetensorsWeights(safetensors_files)
    raise FinetuneError(
        f"checkpoint {checkpoint} holds no model weights (no pytorch_model_fsdp_0/, pytorch_model_fsdp.bin or "
        "model.safetensors); pass a step_<N> folder written by `finetune train`"
    )


class _SafeMetadataReader(FileSystemReader):
    """Reads DCP's `.metadata` pickle allowing only the checkpoint metadata types, never arbitrary code."""

    def read_metadata(self, *args, **kwargs):
        if not hasattr(self, "_metadata"):
            with open(Path(self.path) / ".metadata", "rb") as f:
                self._metadata = MetadataUnpickler(f).load()
        return self._metadata


def read_checked(weights: CheckpointWeights, targets: dict[str, torch.Tensor], checkpoint: Path) -> None:
    try:
        weights.read_into(targets)
    except FinetuneError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException; others vary
        if isinstance(exc, CheckpointException):  # it wraps the reader's own exception
            exc = next(iter(exc.failures.values()))[0]
        raise FinetuneError(
            f"cannot read {next(iter(targets))} from checkpoint {checkpoint} ({first_line(exc)}); its files are "
            "damaged or incomplete: export an earlier checkpoint"
        ) from None


def target_dtype(stored: torch.dtype, requested: torch.dtype) -> torch.dtype:
    """Floating tensors take the requested dtype; integer buffers keep theirs."""
    return requested if stored.is_floating_point else stored


def clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")
