"""Launch-environment checks that need no processes."""

from __future__ import annotations

import pytest
import torch

from finetune.distributed import _check_launch_environment
from finetune.errors import FinetuneError


def test_bf16_on_a_gpu_without_bf16_names_the_fix(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla V100-SXM2-32GB")
    with pytest.raises(FinetuneError, match="Tesla V100-SXM2-32GB has no bf16; use mixed_precision: fp16 or 'no'"):
        _check_launch_environment(recipe_activation_checkpointing=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    _check_launch_environment(recipe_activation_checkpointing=False)


def test_activation_checkpointing_in_one_place_is_fine(monkeypatch):
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(FinetuneError, match="remove one of them"):
        _check_launch_environment(recipe_activation_checkpointing=True)
    _check_launch_environment(recipe_activation_checkpointing=False)
