"""Folders that appear complete or not at all: written as `<name>.partial` beside their final place, then renamed.
Checkpoints and exports both write so; a process killed at any point leaves the earlier folder (or none), never a
half-written one under the final name."""

from __future__ import annotations

import os
import shutil
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
