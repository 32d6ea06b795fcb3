"""Checkpoints that never lose work: atomic, resumable, standard accelerate/DCP folders.

A checkpoint is `<output.dir>/checkpoints/step_<N>/`: what `accelerator.save_state` writes (model
and optimizer as torch.distributed.checkpoint shards or full state dicts, as the accelerate config's
state-dict type says; RNG states), plus `trainer_state.json` (step, data position, LR scheduler
state), the resolved recipe, `hf/` (config, generation config and tokenizer files, so that
`finetune export` needs nothing but the checkpoint) and `tensor_names.json` (the model's state-dict
names, tied ones grouped, so that the export needs no model code). It is written as
`step_<N>.partial/` and renamed when complete, with the marker file written last, so a save that
dies halfway never looks complete and never replaces the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from finetune.config import RecipeConfig, save_recipe
from finetune.errors import FinetuneError

logger = logging.getLogger("finetune")

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
MODEL_FILES = "hf"
TENSOR_NAMES = "tensor_names.json"


@dataclass(frozen=True)
class TrainerState:
    """Where training stands after `step` optimizer steps."""

    step: int
    epoch: int
    rows_into_epoch: int
    """Rows of the epoch's global (process-count independent) order already trained on."""
    num_processes: int
    model_name_or_path: str
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The LR scheduler's state_dict, kept as JSON: accelerate would pickle it and unpickle it unsafely."""


def checkpoints_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first. Incomplete folders are reported and never chosen."""
    if not root.is_dir():
        return []
    complete, incomplete = [], []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith("step_"):
            (complete if (path / MARKER).exists() else incomplete).append(path)
    for path in incomplete:
        logger.warning(f"ignoring incomplete checkpoint {path} (no {MARKER} marker: its save did not finish)")
    return sorted(complete, key=lambda p: int(p.name.removeprefix("step_")))


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: `auto` picks the latest complete one (None if there is none)."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoints_root(output_dir))
        return found[-1] if found else None
    path = Path(resume)
    if not (path / MARKER).exists():
        reason = "does not exist" if not path.exists() else f"is incomplete (no {MARKER} marker)"
        raise FinetuneError(f"checkpoint {path} {reason}; pass checkpoint.resume=auto or a complete step_<N> folder")
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
    raise FinetuneError(
        f"{path} is not a complete checkpoint (no {MARKER} marker: its save did not finish, or it is not a "
        "checkpoint); pass an earlier complete step_<N> folder or the run's output dir"
    )


def tensor_names(model: torch.nn.Module) -> list[list[str]]:
    """The model's state-dict names, one group per tensor: a tied parameter is one group of several
    names, the first being the one transformers saves (the input embedding)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: Path,
    state: TrainerState,
    recipe: RecipeConfig,
    keep_last: int,
    write_model_files: Callable[[Path], None],
    names: list[list[str]],
) -> Path:
    """Write `step_<N>` atomically on every process (collective), then prune to the newest `keep_last`.

    `write_model_files(folder)` writes the config, generation config and tokenizer files there;
    `names` are the model's `tensor_names`, taken before FSDP wrapped it.
    """
    root = checkpoints_root(output_dir)
    final = root / f"step_{state.step}"
    partial = root / f"step_{state.step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()  # every rank's shards are on disk before the checkpoint is declared complete
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        save_recipe(recipe, partial / "recipe.yaml")
        write_model_files(partial / MODEL_FILES)
        (partial / TENSOR_NAMES).write_text(json.dumps(names))
        _write_synced(partial / MARKER, f"step {state.step}\n")
        shutil.rmtree(final, ignore_errors=True)  # a complete checkpoint of the same step from an earlier run
        os.replace(partial, final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: Path, recipe: RecipeConfig) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG states from `path`; return where training stands."""
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    if state.model_name_or_path != recipe.model.name_or_path:
        raise FinetuneError(
            f"checkpoint {path} was trained from {state.model_name_or_path!r} but the recipe names "
            f"{recipe.model.name_or_path!r}; resume with the same model.name_or_path or start a new output.dir"
        )
    accelerator.load_state(str(path))
    return state


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
