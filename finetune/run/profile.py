"""`train.profile_steps`: the torch profiler over a range of optimizer steps, on every process.

Where a step's time goes (kernels, collectives, host gaps between them, the optimizer) is what a
tokens/s figure cannot say. Each process writes, once the range is done, a Chrome/Perfetto trace and
a table of the operators that took the most time, under `<output.dir>/profile/`:

    rank0.trace.json   open in https://ui.perfetto.dev or chrome://tracing; each step is a
                       `step N` span, with its forward, backward, collectives and optimizer
    rank0.txt          the operators by self time on the device (GPU) or on the host (CPU)

Only the steps named are recorded, so the profiler costs nothing elsewhere; the first steps of a run
(allocator warm-up, compilation) are usually worth skipping.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    """Records the steps `first..last` (inclusive; none if `steps` is empty), up to the run's `final_step`:
    `begin(step)` before a step's work, `end(step)` after it; `end` returns the log line once the files
    are written. `end(step, stopping=True)` writes what was recorded of a run that stops early."""

    def __init__(self, steps: list[int], final_step: int, out_dir: Path, rank: int, device: torch.device):
        first, last = steps if steps else (0, -1)
        self.first, self.last = first, min(last, final_step)
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.profiler: profile | None = None
        self.span: record_function | None = None

    def begin(self, step: int) -> None:
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()
        if self.profiler is not None:
            self.span = record_function(f"step {step}")
            self.span.__enter__()

    def end(self, step: int, stopping: bool = False) -> str | None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if self.profiler is None or not (step == self.last or stopping):
            return None
        self.last = step
        self.profiler.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{self.rank}.trace.json"
        self._write(trace, lambda path: self.profiler.export_chrome_trace(str(path)))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=sort_by, row_limit=40)
        self._write(self.out_dir / f"rank{self.rank}.txt", lambda path: path.write_text(table + "\n"))
        self.profiler = None
        return (
            f"profile: steps {self.first}-{self.last} recorded to {self.out_dir} "
            f"(rank<N>.trace.json for ui.perfetto.dev, rank<N>.txt by {sort_by.removesuffix('_total')})"
        )

    @staticmethod
    def _write(path: Path, write) -> None:
        """Written beside and renamed into place, so a file there is always whole."""
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        write(partial)
        partial.replace(path)
