"""What online RL logs of its rollouts and losses: sums kept on each process between logs and added up over them
once per log (completion lengths, rewards per function, clipping, the KL, generation time), and the warnings a
window says the user must see (steps that learned nothing, completions that never ended).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from finetune.objectives.policy_loss import TokenLosses

EPISODE_COUNTS = ("turns", "calls", "error", "unknown", "timeout", "unread")
"""What an episode counts (`finetune.rollouts.episodes.Episode.counts`): its model turns, tool calls, calls that
failed (`error`: the tool raised or was misused; `unknown`: no such tool; `timeout`), calls begun and not read."""

_BASE = 11
"""The window's sums before the reward functions' (see `RolloutWindow.__post_init__`)."""


@dataclass
class RolloutWindow:
    """Rollout and loss statistics since the last log, summed on this process (`periodic_metrics` adds them up)."""

    names: tuple[str, ...]
    sums: torch.Tensor = field(init=False)
    longest: float = 0.0
    loss_sums: torch.Tensor | None = None
    """The losses' token counts, on the device they are computed on: summed there, read once per log."""
    episodes: torch.Tensor = field(default_factory=lambda: torch.zeros(len(EPISODE_COUNTS) + 4, dtype=torch.float64))
    """Agents' episodes: how many, then the sums of their `EPISODE_COUNTS`, those cut at the budget and at
    rl.max_turns, and the ids the model wrote."""
    generating_seconds: float = 0.0
    """Wall time this process spent generating, and the rollouts it generated, since the last log."""
    rollouts: int = 0
    tool_seconds: float = 0.0
    """Agents: of that generating time, what decoding spent waiting for tool calls."""

    # completions, their tokens, truncated ones, groups, groups all equal, reward sum, reward square sum,
    # scored completions; dynamic sampling's groups trained, dropped, and trained in steps it could not fill; per
    # function: sum, square sum, scored. The losses': trained tokens, low, high, KL sum.
    def __post_init__(self) -> None:
        self.sums = torch.zeros(_BASE + 3 * len(self.names), dtype=torch.float64)

    def add_rollout(self, rewards: torch.Tensor, per_function: torch.Tensor, lengths: list[int], truncated: list[bool],
                    equal: torch.Tensor, num_generations: int, seconds: float) -> None:  # fmt: skip
        self.generating_seconds += seconds
        self.rollouts += 1
        scored = ~torch.isnan(rewards)
        values = [
            len(lengths), sum(lengths), sum(truncated), len(lengths) / num_generations,
            equal.view(-1, num_generations)[:, 0].sum().item(), rewards[scored].double().sum().item(),
            (rewards[scored].double() ** 2).sum().item(), scored.sum().item(),
        ]  # fmt: skip
        values += [0.0, 0.0, 0.0]  # dynamic sampling's, added by add_refill
        for column in per_function.double().T:
            valid = column[~torch.isnan(column)]
            values += [valid.sum().item(), (valid**2).sum().item(), len(valid)]
        self.sums[: len(values)] += torch.tensor(values, dtype=torch.float64)
        self.longest = max(self.longest, max(lengths))

    def add_refill(self, trained: int, dropped: int, unfilled: bool) -> None:
        """This process's groups of a dynamically sampled step: trained, generated and not trained, and whether the
        step ran out of rounds before every trained group had signal."""
        self.sums[8:_BASE] += torch.tensor([trained, dropped, trained * unfilled], dtype=torch.float64)

    def add_episodes(self, counts: list[dict[str, int]], ends: list[str], written: list[int]) -> None:
        """A rollout's episodes: their counts, how they ended (`finetune.rollouts.episodes.ENDS`) and how many ids
        the model wrote in each."""
        values = [len(counts)] + [sum(c[name] for c in counts) for name in EPISODE_COUNTS]
        values += [ends.count("length"), ends.count("turns"), sum(written)]
        self.episodes += torch.tensor(values, dtype=torch.float64)

    def add_losses(self, mask: torch.Tensor, losses: TokenLosses) -> None:
        kl = (losses.kl * mask).sum() if losses.kl is not None else mask.new_zeros(())
        values = torch.stack([mask.sum(), (losses.low_clipped * mask).sum(), (losses.high_clipped * mask).sum(), kl])
        values = values.detach().double()
        self.loss_sums = values if self.loss_sums is None else self.loss_sums + values

    def metrics(self, accelerator: Accelerator, beta: float) -> dict[str, float]:
        device = accelerator.device
        losses = self.loss_sums if self.loss_sums is not None else torch.zeros(4, dtype=torch.float64, device=device)
        together = torch.cat([self.sums.to(device), self.episodes.to(device), losses.to(device)])
        sums = accelerator.reduce(together, "sum").cpu().tolist()
        episodes = sums[len(self.sums) : len(self.sums) + len(self.episodes)]
        # The longest completion, and the slowest process's generation (the others wait for it).
        most = [self.longest, self.generating_seconds, self.tool_seconds]
        most = torch.tensor(most, device=device, dtype=torch.float64)
        if accelerator.num_processes > 1:
            torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        longest, seconds, tool_seconds = most.tolist()
        rollouts = self.rollouts
        self.sums.zero_()
        self.episodes.zero_()
        self.longest, self.loss_sums, self.generating_seconds, self.rollouts = 0.0, None, 0.0, 0
        self.tool_seconds = 0.0
        completions, tokens, truncated, groups, equal, total, squares, scored, trained, dropped, short = sums[:_BASE]
        values = {}
        if completions:  # a rollout since the last log (with num_iterations > 1, a step may train on an old one)
            values = {
                "frac_reward_zero_std": equal / max(groups, 1), "completions/mean_length": tokens / completions,
                "completions/max_length": longest, "completions/clipped_ratio": truncated / completions,
                "generation/seconds": seconds / max(rollouts, 1),
                "generation/tokens_per_second": tokens / max(seconds, 1e-9),
            }  # fmt: skip
            if scored:  # else absent: no completion was scored, and 0 would read as a reward
                values |= {"reward": total / scored, "reward_std": _std(scored, total, squares)}
            if trained:  # dynamic sampling: the groups generated per group trained, and the share left untrained
                values |= {
                    "dynamic_sampling/generated_per_trained": groups / trained,
                    "dynamic_sampling/dropped": dropped / groups, "dynamic_sampling/unfilled": short / trained,
                }  # fmt: skip
            for line in _warnings(completions, truncated, groups, equal, short):
                accelerator.print(f"warning: {line}")
        for n, name in enumerate(self.names if completions else ()):
            function_total, function_squares, function_scored = sums[_BASE + 3 * n : _BASE + 3 + 3 * n]
            if not function_scored:
                accelerator.print(
                    f"warning: rl.rewards: {name} scored none of the {completions:.0f} completions since the last log "
                    "(it returned None for each): it gave these steps no signal; check what it returns"
                )
                continue
            values[f"rewards/{name}/mean"] = function_total / function_scored
            values[f"rewards/{name}/std"] = _std(function_scored, function_total, function_squares)
        if episodes[0]:
            values |= _episode_metrics(*episodes)
            values["generation/tool_seconds"] = tool_seconds / max(rollouts, 1)  # the slowest process's
        trained, low, high, kl = sums[-4:]
        values |= {
            "clip_ratio/low_mean": low / max(trained, 1), "clip_ratio/high_mean": high / max(trained, 1),
            "clip_ratio/region_mean": (low + high) / max(trained, 1),
        }  # fmt: skip
        if beta:
            values["kl"] = kl / max(trained, 1)
        return values


def _episode_metrics(
    episodes: float,
    turns: float,
    calls: float,
    error: float,
    unknown: float,
    timeout: float,
    unread: float,
    cut: float,
    at_max_turns: float,
    written: float,
) -> dict[str, float]:
    """What the log says of agents' episodes, under TRL's names where TRL has one (`tools/...`). TRL's
    completions/mean_length counts only the ids the model wrote when tools answer; finetune's counts every id of
    the episode (the budget's measure) and episodes/written_tokens the model's."""
    return {
        "tools/call_frequency": calls / episodes,
        "tools/failure_frequency": (error + unknown + timeout) / max(calls, 1),
        "tools/unknown_frequency": unknown / max(calls, 1), "tools/timeout_frequency": timeout / max(calls, 1),
        "episodes/turns": turns / episodes, "episodes/unread_calls": unread / episodes,
        "episodes/cut_ratio": cut / episodes, "episodes/max_turns_ratio": at_max_turns / episodes,
        "episodes/written_tokens": written / episodes,
    }  # fmt: skip


def _warnings(completions: float, truncated: float, groups: float, no_signal: float, unfilled: float) -> list[str]:
    """What a logged window of rollouts says the user must know: steps that learned nothing, or completions that
    never finished, or dynamic sampling that ran out of rounds."""
    lines = []
    if unfilled:
        lines.append(
            f"dynamic sampling trained {unfilled:.0f} groups without a reward spread since the last log: "
            "rl.dynamic_sampling_rounds extra rounds of prompts did not find enough with one; raise it, or make the "
            "task's difficulty fit the model"
        )
    if groups and no_signal == groups:
        lines.append(
            f"none of the {groups:.0f} prompts since the last log had completions whose rewards differ (or two "
            "scored): advantages are 0 and these steps trained nothing; the task may be too easy or too hard for "
            "the model, or the rewards may not vary (raise rl.num_generations or rl.temperature, or check them)"
        )
    if completions and truncated == completions:
        lines.append(
            f"every completion since the last log ({completions:.0f}) was cut at rl.max_new_tokens without ending: "
            "raise rl.max_new_tokens, or check that the model's end-of-sequence token ends its replies"
        )
    return lines


def _std(count: float, total: float, squares: float) -> float:
    if count < 2:
        return 0.0
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))
