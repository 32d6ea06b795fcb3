"""Checkpoints that never lose work: atomic, resumable, standard accelerate/DCP folders.

A checkpoint is `<output.dir>/checkpoints/step_<N>/`: what `accelerator.save_state` writes (model
and optimizer as torch.distributed.checkpoint shards or full state dicts, as the accelerate config's
state-dict type says; RNG states), plus `trainer_state.json` (step, data position, LR scheduler
state), the resolved recipe, `hf/` (config and the base's other files, finetune.export.model_files, so that
`finetune export` needs nothing but the checkpoint) and `tensor_names.json` (the model's state-dict
names, tied ones grouped, so that the export needs no model code). It is written as
`step_<N>.partial/` and renamed when complete, with the marker file written last, so a save that
dies halfway never looks complete and never replaces the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException

from finetune.config import RecipeConfig, save_recipe, with_current_keys
from finetune.engine.launch import ASYNC_SAVE_NEEDS
from finetune.errors import FinetuneError, first_line
from finetune.storage.atomic import fresh_partial, move_into_place

logger = logging.getLogger("finetune")

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
MODEL_FILES = "hf"
TENSOR_NAMES = "tensor_names.json"
ADAPTER_STATE = "adapter_state"
"""In the checkpoint of an adapter run: the DCP folder of adapter weights ("model.<name>") and their
optimizer state, in place of accelerate's model and optimizer files (see finetune.model.adapters)."""
ADAPTER_RECORD = "adapter_record.json"
"""In `hf/` of an adapter checkpoint, for the export: "names" (parameter name -> the key PEFT saves it
under), "base" (the base model's `weights_fingerprint`: resume and --merge refuse another base) and,
for QLoRA, "quantized" (which base weights trained in 4 bits, and how: for --merge)."""
_STEP_FOLDER = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class TrainingState:
    """Where training stands after `step` optimizer steps."""

    step: int
    epoch: int
    rows_into_epoch: int
    """Rows of the epoch's global (process-count independent) order already trained on."""
    num_processes: int
    model_name_or_path: str
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The LR scheduler's state_dict, kept as JSON: accelerate would pickle it and unpickle it unsafely."""
    objective: str = "supervised"
    """What the run trained: supervised, or preference (absent from checkpoints older than preference tuning)."""


def checkpoints_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_of(checkpoint: Path) -> int:
    """The optimizer step a `step_<N>` folder was saved at."""
    return int(_STEP_FOLDER.fullmatch(checkpoint.name).group(1))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first. Incomplete folders are reported and never chosen; other
    names (a user's `step_4.bak`, a save in progress `step_5.partial`) are not checkpoints."""
    if not root.is_dir():
        return []
    complete, incomplete = [], []
    for path in root.iterdir():
        if path.is_dir() and _STEP_FOLDER.fullmatch(path.name):
            (complete if (path / MARKER).exists() else incomplete).append(path)
    for path in incomplete:
        logger.warning(f"ignoring incomplete checkpoint {path} (no {MARKER} marker: its save did not finish)")
    return sorted(complete, key=step_of)


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: `auto` picks the latest complete and intact one (None if there
    is none), skipping damaged ones with a warning; an explicit path must be complete and intact."""
    if resume is None:
        return None
    if resume == "auto":
        for path in reversed(complete_checkpoints(checkpoints_root(output_dir))):
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            logger.warning(f"skipping damaged checkpoint {path} ({problem}); trying the one before it")
        return None
    path = Path(resume)
    reason = None
    if not path.exists():
        reason = "does not exist"
    elif not _STEP_FOLDER.fullmatch(path.name):
        reason = "is not a step_<N> checkpoint folder"
    elif not (path / MARKER).exists():
        reason = f"is incomplete (no {MARKER} marker)"
    if reason is not None:
        raise FinetuneError(f"checkpoint {path} {reason}; pass checkpoint.resume=auto or a complete step_<N> folder")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise FinetuneError(f"checkpoint {path} is damaged ({problem}); resume an earlier step_<N> folder")
    return path


def find_checkpoint(path: Path) -> Path:
    """`path` if it is a complete checkpoint, or the latest complete checkpoint of a run's output dir."""
    if (path / MARKER).is_file():
        return path
    if checkpoints_root(path).is_dir():
        found = complete_checkpoints(checkpoints_root(path))
        if found:
            return found[-1]
        raise FinetuneError(f"{path} holds no complete checkpoint; train with checkpoint.save_every_steps > 0")
    if not path.exists():
        raise FinetuneError(f"checkpoint {path} does not exist; pass a step_<N> folder or a run's output dir")
    if (path / "recipe.yaml").is_file():  # a run's output dir
        raise FinetuneError(
            f"{path} is the output dir of a run that saved no checkpoint (it stopped before its first save, or "
            "saved none); nothing to export: train with checkpoint.save_every_steps > 0 or output.export=true"
        )
    raise FinetuneError(
        f"{path} is not a complete checkpoint (no {MARKER} marker: its save did not finish, or it is not a "
        "checkpoint); pass an earlier complete step_<N> folder or the run's output dir"
    )


def checkpoint_problem(path: Path, *, resuming: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot be restored (`resuming`) or exported, or None if every file is whole.

    Reads each file's header (JSON state, DCP metadata, torch and safetensors file tables) and
    checks that every file is as long as its header says; no tensor data is read. A checkpoint
    damaged after its save (a truncated copy, a disk error) is found here, before anything loads.
    """
    try:
        if resuming:  # the export reads weights and model files only
            TrainingState(**json.loads((path / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        return f"{STATE_FILE}: {first_line(exc)}"
    for metadata_file in sorted(path.glob("*/.metadata")):
        problem = _dcp_problem(metadata_file)
        if problem is not None:
            return problem
    for torch_file in sorted(path.glob("*.bin")):
        try:
            torch.load(torch_file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # zip, pickle and unpickling errors vary
            return f"{torch_file.name}: {first_line(exc)}"
    for safetensors_file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(safetensors_file, framework="pt"):
                pass
        except Exception as exc:  # SafetensorError is not an OSError
            return f"{safetensors_file.name}: {first_line(exc)}"
    return None


def _dcp_problem(metadata_file: Path) -> str | None:
    """A torch.distributed.checkpoint folder: its metadata readable, each data file long enough."""
    folder = metadata_file.parent
    try:
        with metadata_file.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except FinetuneError:
        raise
    except Exception as exc:  # truncated or corrupt pickles raise several types
        return f"{folder.name}/.metadata: {first_line(exc)}"
    for name, end in sorted(ends.items()):
        size = (folder / name).stat().st_size if (folder / name).is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"{size:,} bytes of {end:,}"
            return f"{folder.name}/{name} is {found}"
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's `.metadata` pickle allowing only the checkpoint metadata types, never arbitrary code."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str):
        allowed = (
            (module, name) in self._ALLOWED
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise FinetuneError(
                f"checkpoint metadata refers to {module}.{name}, which a torch.distributed.checkpoint metadata file "
                "never does; refusing to load it (the file may have been tampered with)"
            )
        return super().find_class(module, name)


def tensor_names(model: torch.nn.Module) -> list[list[str]]:
    """The model's state-dict names, one group per tensor: a tied parameter is one group of several
    names, the first being the one transformers saves (the input embedding)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


@dataclass
class PendingCheckpoint:
    """A checkpoint whose state is written or being written into `step_<N>.partial/`; it becomes
    complete (marker, rename, pruning) in `finish_checkpoint`, only once every rank's writes ended."""

    partial: Path
    final: Path
    step: int
    keep_last: int
    started: float
    """When the save began (time.perf_counter): the log says how long the checkpoint took to be complete."""
    uploads: list[Future] = field(default_factory=list)
    """Writes still running in the background (asynchronous saves); empty for a synchronous save."""


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: Path,
    state: TrainingState,
    recipe: RecipeConfig,
    write_model_files: Callable[[Path], None],
    names: list[list[str]],
    save_state: Callable[[Path], Any],
) -> PendingCheckpoint:
    """Start writing `step_<N>` on every process (collective); `finish_checkpoint` completes it.

    `save_state(folder)` writes the training state there (collective: accelerate's save_state, the
    adapters' own, or DCP's asynchronous save, which returns the futures of its background writes);
    `write_model_files(folder)` writes the config, generation config and tokenizer files; `names` are
    the model's `tensor_names`, taken before FSDP wrapped it.
    """
    started = time.perf_counter()
    root = checkpoints_root(output_dir)
    final = root / f"step_{state.step}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_main_process:
        fresh_partial(final)
    accelerator.wait_for_everyone()
    with _write_errors(final, output_dir):
        written = save_state(partial)  # accelerate's returns the folder; only futures are waited on
    uploads = written if isinstance(written, list) else []
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        save_recipe(recipe, partial / "recipe.yaml")
        write_model_files(partial / MODEL_FILES)
        (partial / TENSOR_NAMES).write_text(json.dumps(names))
    return PendingCheckpoint(partial, final, state.step, recipe.checkpoint.keep_last, started, uploads)


def finish_checkpoint(accelerator: Accelerator, pending: PendingCheckpoint) -> Path:
    """Wait for this rank's writes, then (all ranks' shards on disk) declare the checkpoint complete:
    marker written last, renamed into place, older checkpoints pruned to `keep_last` (collective)."""
    with _write_errors(pending.final, pending.final.parent.parent):
        for upload in pending.uploads:
            upload.result()
    accelerator.wait_for_everyone()  # every rank's shards are on disk before the checkpoint is declared complete
    if accelerator.is_main_process:
        _write_synced(pending.partial / MARKER, f"step {pending.step}\n")
        move_into_place(pending.partial, pending.final)  # over a checkpoint of the same step from an earlier run
        for old in complete_checkpoints(pending.final.parent)[: -pending.keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    accelerator.print(f"checkpoint: {pending.final.name} saved in {time.perf_counter() - pending.started:.1f} s")
    return pending.final


@contextlib.contextmanager
def _write_errors(final: Path, output_dir: Path) -> Iterator[None]:
    try:
        yield
    except (OSError, SafetensorError, CheckpointException) as exc:  # a full disk or quota, as each writer reports it
        raise FinetuneError(
            f"cannot write checkpoint {final} ({first_line(exc)}); free space under {output_dir} (the previous "
            "checkpoints are intact) and resume with checkpoint.resume=auto"
        ) from None


def async_saver(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[Path], list[Future]]:
    """checkpoint.async_save: DCP's asynchronous save of accelerate's SHARDED layout, over gloo groups of its
    own (created here, on every rank): its background threads never share a group with training or each other."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    sharded = plugin is not None and plugin.fsdp_version == 2 and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    if not sharded:
        raise FinetuneError(ASYNC_SAVE_NEEDS)
    groups = (torch.distributed.new_group(backend="gloo"), torch.distributed.new_group(backend="gloo"))
    return functools.partial(async_save_state, accelerator, model, optimizer, groups)


def async_save_state(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, groups: tuple[Any, Any], folder: Path
) -> list[Future]:
    """accelerate's SHARDED checkpoint of an FSDP2 run (the same folders: `pytorch_model_fsdp_0/` with
    {"model": ...}, `optimizer_0/` with {"optimizer": ...}, then the RNG and sampler states), written by
    DCP's asynchronous save: the state is copied to host memory before this returns (training may then
    change it) and each folder is written by a background thread that talks over a gloo group of its own
    (`groups`), so that no two threads' collectives interleave."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    states = {
        "pytorch_model_fsdp_0": {"model": get_model_state_dict(model)},
        "optimizer_0": {"optimizer": get_optimizer_state_dict(model, optimizer.optimizer)},
    }
    uploads = [
        dcp.async_save(state, checkpoint_id=folder / name, process_group=group)
        for (name, state), group in zip(states.items(), groups, strict=True)
    ]
    save_accelerator_state(
        str(folder), [], [], [], accelerator._dataloaders, accelerator.process_index, accelerator.step
    )
    return uploads


def check_resume_kind(path: Path, adapters: bool) -> None:
    """An adapter checkpoint resumes only an adapter recipe, and a full one only a full recipe."""
    saved_adapters = (path / ADAPTER_STATE).is_dir()
    if saved_adapters != adapters:
        saved, recipe = ("an adapter", "has no peft section") if saved_adapters else ("a full fine-tuning", "has one")
        raise FinetuneError(
            f"checkpoint {path} is of {saved} run but the recipe {recipe}; resume it with the recipe it was trained "
            "with, or start in a new output.dir"
        )


def check_resume_strategy(path: Path, fsdp: bool) -> None:
    """A full fine-tuning checkpoint holds the model and optimizer as its strategy saved them (FSDP: its sharded
    or full state dicts; DDP and one process: safetensors), and accelerate's load_state reads only its own
    strategy's layout. Adapter checkpoints are written in one layout for every strategy."""
    if (path / ADAPTER_STATE).is_dir():
        return
    under_fsdp = (path / "pytorch_model_fsdp_0").is_dir() or any(path.glob("pytorch_model_fsdp*.bin"))
    if under_fsdp == fsdp:
        return
    if under_fsdp:
        raise FinetuneError(
            f"checkpoint {path} was written under FSDP, and this launch has no FSDP: resume it with an FSDP "
            "accelerate config (e.g. accelerate_configs/fsdp2_full_shard.yaml, with any number of processes), or "
            "export it (finetune export) and start a new run from the export"
        )
    raise FinetuneError(
        f"checkpoint {path} was written without FSDP (one process or DDP), and this launch shards with FSDP: resume "
        "it with the config it was written under (e.g. accelerate_configs/single_gpu.yaml or ddp.yaml), or export it "
        "(finetune export) and start a new run from the export"
    )


def check_resume_objective(path: Path, objective: str) -> None:
    """A checkpoint resumes only a run of its own objective: preference tuning after a supervised run (any
    objective after another) starts from that run's export, with a fresh optimizer, not from its checkpoint."""
    saved = json.loads((path / STATE_FILE).read_text()).get("objective", "supervised")
    if saved != objective:
        raise FinetuneError(
            f"checkpoint {path} is of a {saved} run, and this recipe trains {objective}; to train {objective} after "
            f"{saved}, point model.name_or_path at that run's export (<output.dir>/final) and use a new output.dir"
        )


def trained_base(checkpoint: Path) -> str | None:
    """The fingerprint of the base model an adapter checkpoint trained on (None: not recorded)."""
    record = checkpoint / MODEL_FILES / ADAPTER_RECORD
    return json.loads(record.read_text()).get("base") if record.is_file() else None


def check_resume_base(checkpoint: Path, name_or_path: str, folder: Path | None) -> None:
    """Adapters resume only on the base they trained on: the same name is not enough, since a folder
    can be overwritten and a hub model updated, and on another base the adapters would be meaningless.
    `folder` holds the base now (None while a hub model is not cached yet: checked again once it is)."""
    from finetune.storage.fingerprint import matches

    trained = trained_base(checkpoint)
    if trained is not None and folder is not None and not matches(folder, trained):
        raise FinetuneError(
            f"checkpoint {checkpoint} trained its adapters on another base model than {name_or_path!r} holds now "
            f"(its config or weights changed since: fingerprint {trained} then); resume on the base it trained on, "
            "or start a new output.dir"
        )


def load_checkpoint(path: Path, recipe: RecipeConfig, load_state: Callable[[Path], None]) -> TrainingState:
    """Restore model, optimizer and RNG states from `path` with `load_state` (collective); return
    where training stands, with the scheduler's state."""
    state = TrainingState(**json.loads((path / STATE_FILE).read_text()))  # checked by resolve_resume
    if state.model_name_or_path != recipe.model.name_or_path:
        raise FinetuneError(
            f"checkpoint {path} was trained from {state.model_name_or_path!r} but the recipe names "
            f"{recipe.model.name_or_path!r}; resume with the same model.name_or_path or start a new output.dir"
        )
    try:
        load_state(path)
    except FinetuneError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
        raise FinetuneError(
            f"cannot restore checkpoint {path} ({first_line(exc)}); resume an earlier step_<N> folder"
        ) from None
    return state


def recipe_changes(checkpoint: Path, recipe: RecipeConfig) -> list[str]:
    """The settings a resume changes, as "key: then -> now", from the recipe the checkpoint saved: a resume
    trains on with the recipe it is given (a new learning rate, loss or beta takes effect from here), and the
    log says so rather than leaving it to be noticed in the curves."""
    saved = checkpoint / "recipe.yaml"
    if not saved.is_file():
        return []
    # Both as save_recipe writes them, so that a tuple and the list YAML reads it back as compare equal.
    now = yaml.safe_load(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    then, now = _flat(with_current_keys(yaml.safe_load(saved.read_text()) or {})[0]), _flat(now)
    return [
        f"{key}: {then.get(key)} -> {now.get(key)}"
        for key in sorted(then.keys() | now.keys())
        if then.get(key) != now.get(key) and key not in _EXPECTED_TO_CHANGE
    ]


_EXPECTED_TO_CHANGE = {"checkpoint.resume", "output.dir"}  # asked to resume; a copied or moved run


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
