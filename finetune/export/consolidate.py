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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import StateDictSplit, split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import save_file

from finetune.errors import FinetuneError, first_line
from finetune.export.weight_files import (
    CheckpointWeights,
    adapter_tensors,
    open_weights,
    read_checked,
    target_dtype,
)
from finetune.model.family import HubLayout
from finetune.storage.atomic import fresh_partial, move_into_place
from finetune.storage.checkpoint import (
    ADAPTER_RECORD,
    ADAPTER_STATE,
    MODEL_FILES,
    TENSOR_NAMES,
    checkpoint_problem,
    find_checkpoint,
    tensor_names,
)
from finetune.storage.outputs import export_lock

if TYPE_CHECKING:
    from accelerate import Accelerator

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
    the adapter folded in (see finetune.export.merge).

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
        move_into_place(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_export(
    checkpoint: Path, out_dir: Path, dtype: torch.dtype | None, max_shard_size: str, merge: str | None = None
) -> None:
    """The model folder, in the layout the hub stores the model's family in (finetune.model.family.HubLayout);
    `merge` (an adapter checkpoint): what to merge onto, see finetune.export.merge."""
    if merge is not None:
        from finetune.export.merge import merged_weights

        # The base is read from its hub files, so the merged weights are in the hub layout already.
        weights, groups = merged_weights(checkpoint, onto=merge)
        names, hub = _export_names(weights, checkpoint, groups), None
    else:
        weights = open_weights(checkpoint)
        names, hub = _export_names(weights, checkpoint), _hub_layout(checkpoint / MODEL_FILES)
    dtype = dtype or weights.training_dtype()
    layout = {
        name: torch.empty(weights.shapes[source], dtype=target_dtype(weights.dtypes[source], dtype), device="meta")
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
                    read_checked(weights, {names[name]: shard[name] for name in whole}, checkpoint)
                for name in group:
                    if name not in whole:  # read as held, one at a time, then stored in pieces
                        held = torch.empty_like(layout[name], device="cpu")
                        read_checked(weights, {names[name]: held}, checkpoint)
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
        move_into_place(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _hub_layout(model_files: Path) -> HubLayout | None:
    """The hub layout of the model `model_files`/config.json describes (None: stored as held). A model whose
    code transformers lacks (trust_remote_code) has no conversion transformers knows of either."""
    from transformers import AutoConfig

    from finetune.model.loading import meta_model

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

    from finetune.model.loading import meta_model

    return tensor_names(meta_model(AutoConfig.from_pretrained(model_files)))


def _state_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Make config.json state the dtype of the exported weights, so that from_pretrained(dtype="auto")
    loads them as saved. The file was written by the training's save_pretrained; only this key changes."""
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    # A QLoRA base was loaded in 4 bits; the exported weights are plain tensors of `dtype`.
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
    try:
        return fresh_partial(out_dir)
    except OSError as exc:
        raise FinetuneError(
            f"cannot write the export folder {out_dir} ({exc.strerror}); pick a folder you can write to"
        ) from None


FINAL_LOGITS = "final_logits.safetensors"


@torch.no_grad()
def save_final_logits(model: torch.nn.Module, accelerator: Accelerator, path: Path) -> None:
    """Logits of the trained model on a fixed token sequence (collective forward; the main process
    writes them): any reload of the exported model must reproduce them."""
    from finetune.engine.wrap import reshard  # the training side's; an export alone never loads it

    vocab_size = accelerator.unwrap_model(model).config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    model.eval()
    logits = model(input_ids=input_ids.to(accelerator.device), use_cache=False).logits
    reshard(model)
    model.train()
    if accelerator.is_main_process:
        save_file({"input_ids": input_ids, "logits": logits.float().cpu().contiguous()}, path)
