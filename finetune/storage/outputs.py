"""Folders that finetune writes: checked before anything loads, written by one process at a time,
and cleared only of what an earlier run wrote.

A training run owns `output.dir` from its first check to the end of its export: the main process
holds an exclusive lock on `<output.dir>/.finetune.lock` (flock: released by the kernel if the
process dies, so a killed run never blocks the next). An export owns its destination the same way
through `.<name>.export.lock` beside it. A second process finds the lock taken and is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune.errors import FinetuneError
from finetune.storage.checkpoint import checkpoint_problem, checkpoints_root, complete_checkpoints, step_of

if TYPE_CHECKING:
    from accelerate import Accelerator

LOCK = ".finetune.lock"
# Everything a run writes into output.dir. A fresh run removes these and nothing else, so a run
# that fails after starting never leaves an earlier run's results beside its own recipe.
RUN_FILES = ("recipe.yaml", "metrics.jsonl", "final_logits.safetensors", "reference_logps.safetensors")
RUN_FOLDERS = (
    "checkpoints", "ranks", "final", "final.partial", "final.previous", "final_merged", "finetune", "profile"
)  # fmt: skip
"""`finetune` is where accelerate's trackers (tensorboard) write, under the project name; `profile` is
`train.profile_steps`' traces."""
KEPT_ON_RESUME = ("checkpoints", "profile")
"""What a resumed run keeps: its checkpoints, and the traces of steps before the resume."""
KEPT_FILES_ON_RESUME = ("metrics.jsonl", "reference_logps.safetensors")
"""And of its files: the metrics (cut to the step resumed), a preference run's precomputed reference."""


def check_output_dir(output_dir: Path, *, overwrite: bool, resume_from: Path | None, max_steps: int | None) -> None:
    """Refuse, before anything loads, every way this run could lose or mix up earlier results.

    Resuming a checkpoint of this output dir continues that run; anything else is a fresh start,
    which needs an empty folder or `output.overwrite`.
    """
    resolved = output_dir.resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise FinetuneError(
            f"output.dir {output_dir} is the current folder or one above it; a run writes and replaces files there. "
            "Name a folder of its own, e.g. output.dir=outputs/my_run"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise FinetuneError(f"output.dir {output_dir} is a file; name a folder (it is created if missing)")
    continuing = resume_from is not None and resume_from.resolve().parent == checkpoints_root(resolved)
    if resume_from is not None and max_steps is not None and step_of(resume_from) > max_steps:
        raise FinetuneError(
            f"checkpoint {resume_from} is at step {step_of(resume_from)}, past train.max_steps={max_steps}; "
            f"raise train.max_steps above {step_of(resume_from)} to continue, or resume an earlier checkpoint"
        )
    if continuing:
        later = [p.name for p in _later_checkpoints(output_dir, step_of(resume_from)) if checkpoint_problem(p) is None]
        if later and not overwrite:
            raise FinetuneError(
                f"output.dir {output_dir} has checkpoints after {resume_from.name} ({', '.join(later)}), which "
                "resuming would replace; resume the latest with checkpoint.resume=auto, or pass "
                "output.overwrite=true to discard them"
            )
    elif _holds_files(output_dir) and not overwrite:
        raise FinetuneError(
            f"output dir {output_dir} is not empty; choose another output.dir or pass output.overwrite=true "
            "to replace its contents"
        )


def claim_output_dir(output_dir: Path, resumed_step: int | None) -> None:
    """Clear what an earlier run wrote (main process, once everything is built and restored).

    A fresh run removes every earlier output. A resumed run keeps its checkpoints up to the step it
    resumed and its metrics up to that step (the steps after it are trained again), and removes
    the outputs of its end (final model, logits), so the folder never shows a finished run it is not.
    Later checkpoints are gone too: discarded by the user (output.overwrite), or, if damaged (which
    is why `resume=auto` passed them), renamed `step_<N>.damaged`.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in RUN_FOLDERS:
        if resumed_step is None or name not in KEPT_ON_RESUME:
            shutil.rmtree(output_dir / name, ignore_errors=True)
    for name in RUN_FILES:
        if resumed_step is None or name not in KEPT_FILES_ON_RESUME:
            (output_dir / name).unlink(missing_ok=True)
    if resumed_step is None:
        return
    for checkpoint in _later_checkpoints(output_dir, resumed_step):
        if checkpoint_problem(checkpoint) is None:
            shutil.rmtree(checkpoint)  # the user chose to discard it (output.overwrite)
        else:  # kept for inspection, under a name that is never resumed, exported or pruned
            checkpoint.rename(checkpoint.with_name(checkpoint.name + ".damaged"))
    metrics_file = output_dir / "metrics.jsonl"
    if metrics_file.exists():
        kept = [line for line in metrics_file.read_text().splitlines() if _step_of_line(line) <= resumed_step]
        metrics_file.write_text("".join(line + "\n" for line in kept))


@contextlib.contextmanager
def exclusive(lock_file: Path, what: str, busy_hint: str) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (created, with its folder, if missing) for the block.

    Refuses at once, naming the holder, if another process holds it. Folders created for the lock
    are removed again if they are still empty afterwards.
    """
    created = _missing_parents(lock_file)
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise FinetuneError(
            f"cannot write {what} ({exc.strerror}: {exc.filename}); pick a folder you can write to"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The holder unlinks the file before unlocking: a lock won on a file no longer at this path
            # was won after its holder ended, while a newer process may hold the path's new file.
            if not lock_file.exists() or os.stat(lock_file).st_ino != os.fstat(fd).st_ino:
                raise BlockingIOError
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise FinetuneError(f"{what} is in use by {holder}; {busy_hint}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                lock_file.unlink()  # before unlocking, so a waiting process never locks a file already gone
    finally:
        os.close(fd)
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: a run that wrote nothing leaves nothing


def run_lock(output_dir: Path):
    """The lock a training run holds on its output dir from its first check to its export's end."""
    return exclusive(
        output_dir / LOCK, f"output.dir {output_dir}", "wait for that run to end or choose another output.dir"
    )


def export_lock(out_dir: Path):
    """The lock an export holds on its destination (and its .partial folder) while writing it."""
    return exclusive(
        out_dir.with_name(f".{out_dir.name}.export.lock"),
        f"export folder {out_dir}",
        "wait for that export to end or export to another folder",
    )


def _later_checkpoints(output_dir: Path, step: int) -> list[Path]:
    return [p for p in complete_checkpoints(checkpoints_root(output_dir)) if step_of(p) > step]


def _holds_files(folder: Path) -> bool:
    return folder.is_dir() and any(p.name != LOCK for p in folder.iterdir())


def _missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, deepest first."""
    missing = []
    for folder in path.parents:
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _step_of_line(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a damaged line is dropped with the steps trained again


def check_shared_output_dir(output_dir: Path, accelerator: Accelerator) -> None:
    """Every rank must see the same output dir: a checkpoint is written by all ranks together, and a
    machine writing its shards to a local disk would leave checkpoints that no one can resume or export."""
    from accelerate.utils import broadcast_object_list

    marker = output_dir / ".shared-check"
    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    if accelerator.is_main_process:
        marker.write_text(token[0])
    broadcast_object_list(token)  # also the barrier after rank 0 wrote the marker
    sees = marker.is_file() and marker.read_text() == token[0]
    blind = accelerator.gather(torch.tensor([0 if sees else 1], device=accelerator.device))
    if accelerator.is_main_process:
        marker.unlink()
    if blind.any():
        ranks = ", ".join(str(rank) for rank in blind.nonzero().flatten().tolist())
        raise FinetuneError(
            f"output.dir {output_dir} is not the same folder on every machine: rank(s) {ranks} cannot see what rank 0 "
            "wrote there. Put output.dir on a filesystem that all machines share (NFS, Lustre, ...), so that every "
            "checkpoint holds the shards of all ranks"
        )
