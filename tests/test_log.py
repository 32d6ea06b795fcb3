"""A normal run's log is for people: finetune's own lines once (rank 0), one progress bar per tokenized split and
one for training, a line per checkpoint, and nothing from the libraries unless something is wrong."""

from __future__ import annotations

import re

import pytest
from helpers import LaunchedRun

pytestmark = pytest.mark.multiprocess

# Every line a normal run prints, by its start (finetune's own lines and the bars it draws).
ALLOWED = [
    r"strategy: ", r"precision: ", r"attention: ", r"loss: ", r"activation checkpointing: ", r"batch: ",
    r"(train|eval) data: ", r"FSDP wrap plan: ", r"  \w+ +x\d+ +[\d,]+ params each",
    r"memory per rank in step 1", r"rank +params", r" +\d+( +[\d.]+)+$", r"dtypes: ",
    r"tokenizing \(\w+\): +\d+%", r"training: +\d+%", r"checkpoint: step_\d+ saved in [\d.]+ s$",
    r"exported \S+ to \S+$",
]  # fmt: skip


def log_lines(run: LaunchedRun) -> list[str]:
    """The lines a terminal shows at some point (progress bars redraw with carriage returns)."""
    return [line for line in re.split(r"[\r\n]", run.log) if line.strip()]


def test_a_normal_run_prints_only_its_own_lines(fsdp2_run):
    """The demo recipe on 2 processes (FSDP2, packing, evaluation, a checkpoint, the export)."""
    unexpected = [line for line in log_lines(fsdp2_run) if not any(re.match(p, line) for p in ALLOWED)]
    assert unexpected == [], "\n".join(unexpected[:20])
    lines = log_lines(fsdp2_run)
    assert sum(line.startswith("strategy: ") for line in lines) == 1  # rank 0 only
    assert any(re.match(r"checkpoint: step_16 saved in", line) for line in lines)


def test_verbose_leaves_the_libraries_as_they_are(monkeypatch):
    import logging

    from finetune.engine import quiet

    monkeypatch.setenv(quiet.VERBOSE, "1")
    accelerate = logging.getLogger("accelerate")
    level = accelerate.level
    quiet.quiet_libraries()
    assert accelerate.level == level
    with quiet.no_datasets_bars():
        import datasets

        assert datasets.is_progress_bar_enabled()
