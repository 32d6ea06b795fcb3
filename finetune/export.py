"""Export a checkpoint as a Hugging Face model folder with consolidated safetensors weights.

One process, no torch.distributed: the weights are read from the checkpoint straight into the
output shard being assembled (torch.distributed.checkpoint partial loads for SHARDED checkpoints,
memory-mapped reads for FULL ones) and written one output shard at a time, so peak memory stays
about one output shard whatever the model size, and no training process waits on a gather.

The folder is what `AutoModelForCausalLM.from_pretrained` expects: config.json (stating the
exported dtype), generation_config.json, the tokenizer files, and `model.safetensors` or
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`. Tied weights are stored
once, under the name transformers loads them by.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import threading
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import StateDictSplit, split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from finetune.checkpoint import (
    ADAPTER_RECORD,
    ADAPTER_STATE,
    MODEL_FILES,
    TENSOR_NAMES,
    MetadataUnpickler,
    checkpoint_problem,
    find_checkpoint,
    tensor_names,
)
from finetune.errors import FinetuneError, first_line
from finetune.family import HubLayout
from finetune.outputs import export_lock

if TYPE_CHECKING:
    from accelerate import Accelerator

# Wrapper prefixes that FSDP1, activation checkpointing, torch.compile and DDP add to parameter names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# Tensors read together from the checkpoint, as a fraction of the output shard size: this bounds
# the memory a read holds besides the shard (pieces as saved, copies in the checkpoint's dtype).
_READ_FRACTION = 10
# Offsets of the tensors inside a shard's buffer: any dtype can view memory aligned like this.
_ALIGN = 64
_NOT_ADAPTER_FILES = ("config.json", "generation_config.json", ADAPTER_RECORD)


def export_checkpoint(
    checkpoint: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    merge: bool = False,
    merge_onto: str = "dequantized",
) -> Path:
    """Write the model of `checkpoint` (a `step_<N>` folder, or a run's output dir for its latest
    checkpoint) to `out_dir`; `dtype` None keeps the dtype the parameters were trained in. An
    adapter checkpoint is written as a PEFT adapter folder, or with `merge` as the base model with
    the adapter folded in (see finetune.merge).

    The folder is written as `<out_dir>.partial` and renamed when complete, so `out_dir` never
    holds a half-written model, and an earlier model there is replaced only by a complete one.
    """
    checkpoint = find_checkpoint(checkpoint)
    if not (checkpoint / MODEL_FILES / "config.json").is_file():
        raise FinetuneError(
            f"checkpoint {checkpoint} has no {MODEL_FILES}/config.json (the model's config and tokenizer files, saved "
            f"with every checkpoint): it was copied without its {MODEL_FILES}/ folder; copy the whole step folder"
        )
    _check_out_dir(out_dir, overwrite, checkpoint)
    if merge:
        _check_not_the_base(out_dir, checkpoint)
    problem = checkpoint_problem(checkpoint, resuming=False)
    if problem is not None:
        raise FinetuneError(f"checkpoint {checkpoint} is damaged ({problem}); export an earlier checkpoint")
    adapter = (checkpoint / ADAPTER_STATE).is_dir()
    if merge and not adapter:
        raise FinetuneError(
            f"--merge folds an adapter into its base model, but checkpoint {checkpoint} is of a full fine-tuning run, "
            "whose export is the whole model already; drop --merge"
        )
    with export_lock(out_dir), stopped_by_signals(checkpoint, out_dir):
        if adapter and not merge:
            _write_adapter_export(checkpoint, out_dir, dtype)
        else:
            _write_export(checkpoint, out_dir, dtype, max_shard_size, merge=merge_onto if merge else None)
    return out_dir


def adapter_tensors(checkpoint: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter of an adapter checkpoint under PEFT's names, as trained (fp32) or in `dtype`. Only
    the adapter's tensors are read (a small fraction of the model), never the base's."""
    names: dict[str, str] = json.loads((checkpoint / MODEL_FILES / ADAPTER_RECORD).read_text())["names"]
    weights = _ShardedWeights(checkpoint / ADAPTER_STATE)
    missing = [name for name in names if name not in weights.shapes]
    if missing:
        raise FinetuneError(
            f"checkpoint {checkpoint} lacks adapter tensors ({', '.join(missing[:3])}); export a checkpoint written "
            "by `finetune train`, unmodified"
        )
    stored = weights.dtypes
    tensors = {
        name: torch.empty(weights.shapes[name], dtype=_target_dtype(stored[name], dtype or stored[name]))
        for name in names
    }
    _read_into(weights, tensors, checkpoint)
    return {names[name]: tensor for name, tensor in tensors.items()}


def _write_adapter_export(checkpoint: Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """The adapter as the folder PEFT writes: `adapter_model.safetensors` under PEFT's names,
    `adapter_config.json` naming the base model, the tokenizer."""
    adapter = adapter_tensors(checkpoint, dtype)
    partial = _make_partial(out_dir)
    try:
        for source in (checkpoint / MODEL_FILES).iterdir():
            if source.name not in _NOT_ADAPTER_FILES:  # the base model's own files would make OUT look like a model
                shutil.copy2(source, partial / source.name)
        _save_shard(adapter, partial / "adapter_model.safetensors", out_dir)
        _replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_export(
    checkpoint: Path, out_dir: Path, dtype: torch.dtype | None, max_shard_size: str, merge: str | None = None
) -> None:
    """The model folder, in the layout the hub stores the model's family in (finetune.family.HubLayout);
    `merge` (an adapter checkpoint): what to merge onto, see finetune.merge."""
    if merge is not None:
        from finetune.merge import merged_weights

        # The base is read from its hub files, so the merged weights are in the hub layout already.
        weights, groups = merged_weights(checkpoint, onto=merge)
        names, hub = _export_names(weights, checkpoint, groups), None
    else:
        weights = open_weights(checkpoint)
        names, hub = _export_names(weights, checkpoint), _hub_layout(checkpoint / MODEL_FILES)
    dtype = dtype or weights.training_dtype()
    layout = {
        name: torch.empty(weights.shapes[source], dtype=_target_dtype(weights.dtypes[source], dtype), device="meta")
        for name, source in names.items()
    }
    # Each tensor as the hub stores it: itself, renamed, or (a fused MoE tensor) split into several.
    stored_as = {name: hub.convert(name, meta) if hub else {name: meta} for name, meta in layout.items()}
    # Shards are planned over the tensors as held, so a fused tensor and its pieces end in one shard.
    split = _plan_shards(layout, max_shard_size)
    partial = _make_partial(out_dir)
    try:
        # tokenizer, configs (not an adapter's: a merged model is a plain transformers model)
        adapter_files = shutil.ignore_patterns(ADAPTER_RECORD, "adapter_config.json")
        shutil.copytree(checkpoint / MODEL_FILES, partial, dirs_exist_ok=True, ignore=adapter_files)
        _state_dtype(partial / "config.json", dtype)
        largest_shard = max(_nbytes(layout, tensors) for tensors in split.filename_to_tensors.values())
        read_budget = max(largest_shard // _READ_FRACTION, 1)
        stored = {name: weights.shapes[src].numel() * weights.dtypes[src].itemsize for name, src in names.items()}
        for filename, shard_names in split.filename_to_tensors.items():
            shard = _allocate({piece: t for name in shard_names for piece, t in stored_as[name].items()})
            for group in _read_groups({name: stored[name] for name in shard_names}, read_budget):
                whole = [name for name in group if name in stored_as[name]]  # stored as held: read in place
                if whole:
                    _read_into(weights, {names[name]: shard[name] for name in whole}, checkpoint)
                for name in group:
                    if name not in whole:  # read as held, one at a time, then stored in pieces
                        held = torch.empty_like(layout[name], device="cpu")
                        _read_into(weights, {names[name]: held}, checkpoint)
                        for piece, value in hub.convert(name, held).items():
                            shard[piece].copy_(value)
            _save_shard(shard, partial / filename, out_dir)
            del shard
        if split.is_sharded:
            weight_map = {
                piece: filename for name, filename in split.tensor_to_filename.items() for piece in stored_as[name]
            }
            index = {"metadata": split.metadata, "weight_map": weight_map}
            (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _hub_layout(model_files: Path) -> HubLayout | None:
    """The hub layout of the model `model_files`/config.json describes (None: stored as held). A model whose
    code transformers lacks (trust_remote_code) has no conversion transformers knows of either."""
    from transformers import AutoConfig

    from finetune.model import meta_model

    try:
        config = AutoConfig.from_pretrained(model_files)
    except ValueError:  # a model type transformers does not know
        return None
    return HubLayout.of(meta_model(config))


@contextlib.contextmanager
def stopped_by_signals(checkpoint: Path, out_dir: Path) -> Iterator[None]:
    """Turn SIGTERM and Ctrl-C during an export into a user error that says how to finish it (the
    partial folder is removed on the way out; the checkpoint is untouched)."""

    def stop(signum: int, frame: object) -> None:
        raise FinetuneError(
            f"the export to {out_dir} was stopped by {signal.Signals(signum).name} and nothing was written there; "
            f"checkpoint {checkpoint} is complete: finish with `finetune export {checkpoint} {out_dir} --overwrite`"
        )

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _save_shard(shard: dict[str, torch.Tensor], path: Path, out_dir: Path) -> None:
    try:
        save_file(shard, path, metadata={"format": "pt"})
    except (OSError, SafetensorError) as exc:  # a full disk or a quota, raised by either
        raise FinetuneError(
            f"cannot write the export to {out_dir} ({first_line(exc)}); free space there or export to another folder"
        ) from None


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


class _ShardedWeights(CheckpointWeights):
    """A SHARDED checkpoint: torch.distributed.checkpoint files, one per saving rank."""

    def __init__(self, folder: Path):
        self.reader = _SafeMetadataReader(folder)
        metadata = self.reader.read_metadata().state_dict_metadata
        # accelerate saves {"model": model.state_dict()}, which DCP flattens to "model.<name>".
        # The model's tensors only: an adapter checkpoint keeps its optimizer state in the same folder.
        self.keys = {
            _clean(key.removeprefix("model.")): key
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


class _TorchFileWeights(CheckpointWeights):
    """A FULL checkpoint of an FSDP run: one torch.save file, memory-mapped so it is read lazily."""

    def __init__(self, path: Path):
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        self.tensors = {_clean(key): tensor for key, tensor in loaded.items()}
        super().__init__(
            {name: t.shape for name, t in self.tensors.items()}, {name: t.dtype for name, t in self.tensors.items()}
        )

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        for name, target in targets.items():
            target.copy_(self.tensors[name])  # the file's pages are read here


class _SafetensorsWeights(CheckpointWeights):
    """The full model as safetensors files (DDP and single-process checkpoints)."""

    def __init__(self, paths: list[Path]):
        self.files: dict[str, tuple[Path, str]] = {}
        shapes, dtypes = {}, {}
        for path in paths:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    view = f.get_slice(key)
                    name = _clean(key)
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
        return _ShardedWeights(checkpoint / "pytorch_model_fsdp_0")
    full = sorted(checkpoint.glob("pytorch_model_fsdp*.bin"))
    if full:
        return _TorchFileWeights(full[0])
    safetensors_files = sorted(checkpoint.glob("model*.safetensors"))
    if safetensors_files:
        return _SafetensorsWeights(safetensors_files)
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


def _export_names(
    weights: CheckpointWeights, checkpoint: Path, groups: list[list[str]] | None = None
) -> dict[str, str]:
    """Exported name -> checkpoint name, for every tensor of the model.

    The model's names are those training saved with the checkpoint (the names from_pretrained
    loads, tied ones grouped) or, for a checkpoint without them, those of the model its config
    describes. A tied parameter has several names; it is exported once, under the first (the input
    embedding, as transformers saves it), from whichever of its names the checkpoint holds.
    """
    saved = checkpoint / TENSOR_NAMES
    if groups is not None:  # a merge: the base model's names
        described = f"{MODEL_FILES}/config.json"
    elif saved.is_file():
        groups, described = json.loads(saved.read_text()), TENSOR_NAMES
    else:
        groups, described = _model_tensor_names(checkpoint / MODEL_FILES), f"{MODEL_FILES}/config.json"
    names, missing = {}, []
    for group in groups:
        source = next((name for name in group if name in weights.shapes), None)
        if source is None:
            missing.append(group[0])
        else:
            names[group[0]] = source
    known = {name for group in groups for name in group}
    unexpected = sorted(set(weights.shapes) - known)
    if missing or unexpected:
        listed = f"missing: {', '.join(missing[:5]) or 'none'}; unexpected: {', '.join(unexpected[:5]) or 'none'}"
        raise FinetuneError(
            f"checkpoint {checkpoint} does not hold the tensors of the model its {described} describes ({listed}); "
            "export a checkpoint written by `finetune train`, unmodified"
        )
    return names


def _model_tensor_names(model_files: Path) -> list[list[str]]:
    """The `tensor_names` of the model `model_files`/config.json describes, built on the meta device, for a
    checkpoint that does not carry its names (written before finetune saved them)."""
    from transformers import AutoConfig

    from finetune.model import meta_model

    return tensor_names(meta_model(AutoConfig.from_pretrained(model_files)))


def _state_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Make config.json state the dtype of the exported weights, so that from_pretrained(dtype="auto")
    loads them as saved. The file was written by the training's save_pretrained; only this key changes."""
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    # A QLoRA base was loaded in 4 bits; the exported weights are plain tensors of `dtype`.
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_into(weights: CheckpointWeights, targets: dict[str, torch.Tensor], checkpoint: Path) -> None:
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


def _target_dtype(stored: torch.dtype, requested: torch.dtype) -> torch.dtype:
    """Floating tensors take the requested dtype; integer buffers keep theirs."""
    return requested if stored.is_floating_point else stored


def _allocate(layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors like the (meta) tensors of `layout`, one output shard's, all views of one buffer.

    One allocation per shard, rather than one per tensor, because malloc serves tensors below its
    (self-adjusting, up to 32 MB) mmap threshold from the heap: freed, they stay in the process as
    fragments the next shard cannot all reuse, and the peak grew to nearly twice a shard. A buffer
    of a whole shard is mapped and unmapped as one, so each shard's memory is returned once written.
    """
    views, end = {}, 0
    for name in layout:
        views[name] = (end, _nbytes(layout, [name]))
        end += -(-views[name][1] // _ALIGN) * _ALIGN
    buffer = torch.empty(end, dtype=torch.uint8)
    return {
        name: buffer[offset : offset + size].view(layout[name].dtype).view(layout[name].shape)
        for name, (offset, size) in views.items()
    }


def _read_groups(stored: dict[str, int], budget: int) -> Iterator[list[str]]:
    """The tensors of `stored` (name -> bytes in the checkpoint) in groups of at most `budget` bytes (a
    larger tensor forms a group alone), largest first.

    Reading a tensor holds one of its saved pieces in memory besides the shard (and, when cast, a
    copy in the checkpoint's dtype): reading the large ones first, while the shard is still mostly
    empty (its pages are touched only when filled), keeps the peak near the shard's size.
    """
    group: list[str] = []
    size = 0
    for name in sorted(stored, key=stored.__getitem__, reverse=True):
        nbytes = stored[name]
        if group and size + nbytes > budget:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


def _plan_shards(layout: dict[str, torch.Tensor], max_shard_size: str) -> StateDictSplit:
    """Which tensors go to which file, named and indexed as transformers' save_pretrained does."""
    size = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*[KMGT]B\s*", max_shard_size, re.IGNORECASE)
    if size is None or float(size.group(1)) <= 0:
        raise FinetuneError(f"max shard size {max_shard_size!r} is not a size; write it like 5GB, 500MB or 100KB")
    return split_torch_state_dict_into_shards(
        layout, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size.upper().replace(" ", "")
    )


def _nbytes(layout: dict[str, torch.Tensor], names: list[str]) -> int:
    return sum(layout[name].numel() * layout[name].element_size() for name in names)


def _check_out_dir(out_dir: Path, overwrite: bool, checkpoint: Path) -> None:
    """Refuse to replace a model (or anything else) without overwrite, and any folder that holds,
    is, or lies inside the checkpoint: replacing it would delete the source of the export."""
    out, source = out_dir.resolve(), checkpoint.resolve()
    if out == source or source in out.parents or out in source.parents:
        where = "is" if out == source else "lies inside" if source in out.parents else "holds"
        raise FinetuneError(
            f"export folder {out_dir} {where} the checkpoint {checkpoint} it exports, which writing it would "
            "destroy; export to a folder outside it, e.g. <output.dir>/final"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise FinetuneError(f"export folder {out_dir} is a file; pass a folder path")
    if (out_dir / "checkpoints").is_dir() or (out_dir / "recipe.yaml").is_file():
        raise FinetuneError(
            f"export folder {out_dir} is a training run's output folder (it holds checkpoints or a recipe.yaml), "
            "which --overwrite would delete; export into a folder of its own, e.g. <output.dir>/final"
        )
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        holds = "a model" if (out_dir / "config.json").exists() else "files"
        raise FinetuneError(f"export folder {out_dir} already holds {holds}; pass --overwrite or another folder")


def _check_not_the_base(out_dir: Path, checkpoint: Path) -> None:
    """A merge reads the base model the adapter names: writing over it would destroy what the adapter needs."""
    config = checkpoint / MODEL_FILES / "adapter_config.json"
    base = json.loads(config.read_text()).get("base_model_name_or_path") if config.is_file() else None
    if base and Path(base).expanduser().is_dir() and Path(base).expanduser().resolve() == out_dir.resolve():
        raise FinetuneError(
            f"export folder {out_dir} is the base model the adapter is merged into, which writing there would "
            "replace; export the merged model to another folder"
        )


def _make_partial(out_dir: Path) -> Path:
    """The empty folder the export is written into, next to out_dir; fails early if it can't be written."""
    partial = out_dir.with_name(out_dir.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    except OSError as exc:
        raise FinetuneError(
            f"cannot write the export folder {out_dir} ({exc.strerror}); pick a folder you can write to"
        ) from None
    return partial


def _replace(partial: Path, out_dir: Path) -> None:
    """Move the complete folder into place; an earlier folder there is removed only afterwards."""
    previous = out_dir.with_name(out_dir.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(previous)
    partial.rename(out_dir)
    shutil.rmtree(previous, ignore_errors=True)


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


FINAL_LOGITS = "final_logits.safetensors"


@torch.no_grad()
def save_final_logits(model: torch.nn.Module, accelerator: Accelerator, path: Path) -> None:
    """Logits of the trained model on a fixed token sequence (collective forward; the main process
    writes them): any reload of the exported model must reproduce them."""
    from finetune.wrap import reshard  # the training side's; an export alone never loads it

    vocab_size = accelerator.unwrap_model(model).config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    model.eval()
    logits = model(input_ids=input_ids.to(accelerator.device), use_cache=False).logits
    reshard(model)
    model.train()
    if accelerator.is_main_process:
        save_file({"input_ids": input_ids, "logits": logits.float().cpu().contiguous()}, path)
