"""What a run trains: every weight of the model, or adapters on a frozen base (`finetune.model.adapters`).

Chosen once from the recipe (`weights_for`); the build, the checkpoints and the log ask this object, never
`recipe.peft`, as torchtitan applies LoRA as a model converter its trainer never sees. Both kinds answer the same
questions: the checks before anything loads, the base's quantization, the model as trained, the record its export
needs, how a checkpoint saves and restores its state, and the run's precision and parameter lines.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from finetune.config import RecipeConfig
from finetune.engine.accelerator import precision_policy
from finetune.model.loading import DTYPES, check_quantized_base
from finetune.storage.checkpoint import async_saver, check_resume_kind

BaseSwitch = Callable[[torch.nn.Module], AbstractContextManager[None]]
"""Given the model as prepared (wrapped or not), a context inside which it computes as its base."""

StateIO = tuple[Callable[[Path], Any], Callable[[Path], None]]
"""What writes the training state into a checkpoint folder (collective; an asynchronous save returns the futures
of its background writes), and what reads it back."""


class Weights(Protocol):
    quantization: str | None
    """The base's quantization for training (nf4: QLoRA), or None."""
    expert_key: str | None
    """The recipe key that adapts a mixture's fused expert weights (peft.target_experts or target_parameters)."""
    record: dict[str, Any] | None
    """What the export needs to know of an adapter run (`adapters.adapter_record`), once `prepare` ran; else None."""

    def preflight(self) -> None:
        """What can be checked before any weight loads (the base's stored quantization)."""
        ...

    def check_resume(self, resume_from: Path) -> None:
        """The checkpoint to resume holds this kind of weights' state, of the same settings and base."""
        ...

    def load_quantization(self, accelerator: Accelerator) -> Any:
        """The transformers quantization config the base loads with, or None."""
        ...

    def prepare(self, model: torch.nn.Module, resume_from: Path | None) -> torch.nn.Module:
        """The model as it trains (adapters added), before it is sharded."""
        ...

    def state_io(
        self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, async_save: bool
    ) -> StateIO: ...

    def precision_line(self, accelerator: Accelerator, model: torch.nn.Module) -> str: ...

    def describe(self, model: torch.nn.Module) -> str | None:
        """The log line of what trains and what is frozen, or None where everything trains."""
        ...

    def base_switch(self) -> BaseSwitch | None:
        """What makes the model being trained compute as the base it started from while a context lasts (its
        adapters switched off): an objective's reference without a second copy of the weights. None where training
        changes the base's own weights: a reference must then be a frozen copy of the base, loaded beside it."""
        ...


class FullWeights:
    """Full fine-tuning: every parameter trains, checkpoints hold the whole model's state."""

    quantization = None
    expert_key = None
    record = None

    def __init__(self, recipe: RecipeConfig):
        self.recipe = recipe

    def preflight(self) -> None:
        check_quantized_base(self.recipe.model, adapters=False)

    def check_resume(self, resume_from: Path) -> None:
        check_resume_kind(resume_from, adapters=False)

    def load_quantization(self, accelerator: Accelerator) -> None:
        return None

    def prepare(self, model: torch.nn.Module, resume_from: Path | None) -> torch.nn.Module:
        return model

    def state_io(
        self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, async_save: bool
    ) -> StateIO:
        if async_save:
            return async_saver(accelerator, model, optimizer), accelerator.load_state
        return (lambda folder: accelerator.save_state(str(folder))), accelerator.load_state

    def precision_line(self, accelerator: Accelerator, model: torch.nn.Module) -> str:
        return precision_policy(accelerator, DTYPES[self.recipe.model.dtype], next(model.parameters()).dtype)

    def describe(self, model: torch.nn.Module) -> None:
        return None

    def base_switch(self) -> None:
        return None


def weights_for(recipe: RecipeConfig) -> Weights:
    """The recipe's weights: adapters with a `peft` section (importing peft, 2 s, for adapter runs only)."""
    if recipe.peft is None:
        return FullWeights(recipe)
    from finetune.model.adapters import AdapterWeights

    return AdapterWeights(recipe)
