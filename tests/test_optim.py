"""The learning-rate schedule as a pure function."""

from __future__ import annotations

import pytest

from finetune.run.optim import lr_factor


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


def test_fused_adamw_makes_the_updates_of_the_default_one():
    """The loop asks for fused AdamW on CUDA and CPU; its CPU kernel against the default loop is checked here."""
    import torch

    from finetune.config import OptimConfig
    from finetune.run.optim import build_optimizer

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(33, 17, generator=generator), torch.randn(5, generator=generator)]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    runs = {}
    for fused in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = build_optimizer(params, cfg, fused=fused)
        assert bool(optimizer.defaults["fused"]) == fused
        for step in range(5):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            optimizer.step()
        runs[fused] = params
    for a, b in zip(runs[False], runs[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_training_command_lets_the_cuda_allocator_expand_segments():
    from finetune.cli import use_expandable_segments

    environ: dict[str, str] = {}
    use_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for given in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, {"PYTORCH_ALLOC_CONF": "x:1"}):
        kept = dict(given)
        use_expandable_segments(kept)
        assert kept == given  # a setting of the user's stays
