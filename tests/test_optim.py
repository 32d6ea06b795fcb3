"""The learning-rate schedule as a pure function."""

from __future__ import annotations

import pytest

from finetune.optim import lr_factor


def factors(schedule: str, max_steps: int = 12, warmup_steps: int = 2, min_lr_ratio: float = 0.1) -> list[float]:
    return [
        lr_factor(step, warmup_steps=warmup_steps, max_steps=max_steps, schedule=schedule, min_lr_ratio=min_lr_ratio)
        for step in range(max_steps)
    ]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_warmup_then_decay_to_min_on_last_update(schedule):
    values = factors(schedule)
    assert values[0] == pytest.approx(1 / 3) and values[1] == pytest.approx(2 / 3)
    assert values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:], strict=False))


def test_cosine_and_linear_midpoints():
    # 2 warmup steps, decay over steps 2..11: step 6.5 would be the midpoint; compare steps 2 and 11 around it.
    cosine, linear = (
        factors("cosine", max_steps=11, warmup_steps=0, min_lr_ratio=0.0),
        factors("linear", max_steps=11, warmup_steps=0, min_lr_ratio=0.0),
    )
    assert cosine[5] == pytest.approx(0.5) and linear[5] == pytest.approx(0.5)
    assert cosine[2] > linear[2] and cosine[8] < linear[8]


def test_constant_after_warmup():
    assert factors("constant")[2:] == [1.0] * 10
