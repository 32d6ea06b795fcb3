"""`train.profile_steps` (finetune.run.profile): what the profiler writes, and for which steps. The launched
2-process case (both ranks' traces under FSDP2) is in test_loss's FSDP2 run."""

from __future__ import annotations

import json

import torch

from finetune.run.profile import StepProfiler


def spans(path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({event["name"] for event in events if event.get("name", "").startswith("step ")})


def run(profiler: StepProfiler, steps: range, stop_at: int | None = None) -> list[str]:
    lines, weight = [], torch.randn(64, 64)
    for step in steps:
        profiler.begin(step)
        (weight @ weight).sum()
        stopping = step == stop_at
        line = profiler.end(step, stopping=stopping)
        lines += [line] if line else []
        if stopping:
            break
    return lines


def test_the_steps_named_are_recorded_and_written_whole(tmp_path):
    lines = run(StepProfiler([2, 3], 10, tmp_path / "profile", 1, torch.device("cpu")), range(1, 11))
    assert lines == [f"profile: steps 2-3 recorded to {tmp_path / 'profile'} (rank<N>.trace.json for "
                     "ui.perfetto.dev, rank<N>.txt by self_cpu_time)"]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank1.trace.json", "rank1.txt"]
    assert spans(tmp_path / "profile" / "rank1.trace.json") == ["step 2", "step 3"]
    assert "aten::mm" in (tmp_path / "profile" / "rank1.txt").read_text()


def test_a_range_past_the_run_or_cut_by_a_stop_is_written_as_far_as_it_ran(tmp_path):
    # Past the last step: written at the last step.
    lines = run(StepProfiler([3, 50], 4, tmp_path / "a", 0, torch.device("cpu")), range(1, 5))
    assert len(lines) == 1 and "steps 3-4" in lines[0] and spans(tmp_path / "a" / "rank0.trace.json") == [
        "step 3", "step 4"
    ]  # fmt: skip
    # A preemption stop inside the range: written at that step.
    lines = run(StepProfiler([2, 8], 10, tmp_path / "b", 0, torch.device("cpu")), range(1, 11), stop_at=4)
    assert len(lines) == 1 and "steps 2-4" in lines[0]
    # Resumed past the range's start, or no range: nothing recorded, nothing written.
    assert run(StepProfiler([2, 3], 10, tmp_path / "c", 0, torch.device("cpu")), range(3, 11)) == []
    assert run(StepProfiler([], 10, tmp_path / "d", 0, torch.device("cpu")), range(1, 11)) == []
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
