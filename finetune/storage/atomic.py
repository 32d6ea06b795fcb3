"""Folders that appear complete or not at all: written as `<name>.partial` beside their final place, then renamed.
Checkpoints and exports both write so; a process killed at any point leaves the earlier folder (or none), never a
half-written one under the final name.

Caches that several runs may write at once (a sweep's runs computing one teacher table or DPO reference) write
into a partial of their own (`private_partial`) and publish it with `publish_shared`: no writer removes or fills
another's, and the first complete copy to arrive stands."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from pathlib import Path


def fresh_partial(final: Path) -> Path:
    """The empty `<final>.partial` folder to write into (one left by an interrupted write is removed first)."""
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def move_into_place(partial: Path, final: Path) -> None:
    """Rename the complete `partial` to `final`; an earlier `final` is set aside first and removed only afterwards,
    so there is always one complete folder to fall back on."""
    previous = final.with_name(final.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        final.rename(previous)
    os.replace(partial, final)
    shutil.rmtree(previous, ignore_errors=True)


def private_partial(final: Path) -> Path:
    """`<final>.partial-<host>-<pid>-<random>`: a name no other writer of `final` shares (another process, another
    run, another machine on a shared file system), so that none removes or writes into another's."""
    return final.with_name(f"{final.name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish_shared(partial: Path, final: Path) -> None:
    """Rename a complete `partial` to `final`, which other writers of the same content may be publishing too: a
    file replaces theirs (the same bytes; a reader holding the old one keeps reading it), a folder that finds theirs
    already there gives way to it (a folder is never removed under a reader)."""
    try:
        os.rename(partial, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(partial, ignore_errors=True)
