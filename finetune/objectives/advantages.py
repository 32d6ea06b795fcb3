"""A completion's advantage: its reward against its group's (GRPO's), scaled by the group's or the step's standard
deviation, or not at all (Dr. GRPO's). Completions come grouped by prompt, `num_generations` a group, in order; a
group whose rewards all tie (or with fewer than two scored) carries no signal, which dynamic sampling replaces.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

STD_EPSILON = 1e-4
"""Added to the standard deviation that divides advantages (TRL's), so a group of almost equal rewards does not
blow up."""


def advantages(
    rewards_per_function: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale: str,
    batch_moments: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, rewards, whether each row's group carries no signal), per completion, from its rewards per
    function (NaN: not scored by it), completions grouped by prompt in order. A completion no function scored has
    no reward and advantage 0, and is left out of its group's mean and deviation; a group without two scored
    completions, or whose rewards are all equal, teaches nothing. `batch_moments` sums (count, sum, sum of
    squares) over every process, for scale=batch."""
    unscorable = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights).nansum(dim=1)
    rewards[unscorable] = math.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    group_std = _nanstd(grouped).repeat_interleave(num_generations)
    if scale == "batch":
        valid = rewards[~unscorable].double()
        count, total, squares = batch_moments(
            torch.stack([valid.new_tensor(len(valid)), valid.sum(), (valid**2).sum()])
        )
        variance = (squares - total**2 / count) / (count - 1) if count > 1 else torch.tensor(math.nan)
        std = variance.clamp(min=0).sqrt().float().expand_as(rewards)
    else:
        std = group_std
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + STD_EPSILON)
    no_signal = torch.isnan(group_std) | torch.isclose(group_std, torch.zeros_like(group_std))
    return torch.nan_to_num(advantage, nan=0.0), rewards, no_signal


def _nanstd(grouped: torch.Tensor) -> torch.Tensor:
    """Each row's standard deviation over its values that are not NaN (Bessel-corrected; NaN for fewer than 2)."""
    count = (~torch.isnan(grouped)).sum(dim=1)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    variance = torch.nanmean((grouped - mean) ** 2, dim=1) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, math.nan)).sqrt()
