"""Online RL with verifiable rewards: GRPO, and DAPO's and Dr. GRPO's losses (the `rl` section).

A step's prompts (the loop's micro-batches of prompt-only samples, `finetune.data.prompt_only`) are answered
`num_generations` times each by the model as it stands (`rollout`): sampled with seeded noise
(`finetune.generation`), scored by the rewards (`finetune.rewards`), and each completion's advantage is its
reward minus its group's mean, divided by the group's (or the step's) standard deviation. Every completion of a
prompt is sampled on the process that holds the prompt, so a group's statistics need no communication, and the
noise depends on the prompt's number and the rollout, never on the process: the same completions on any
process count. Each micro-batch of prompts becomes a micro-batch of their completions (prompt + completion rows,
right-padded, the completion tokens trained).

The loss of a completion token is PPO's clipped surrogate (TRL's definitions, equal to its `GRPOTrainer` on the
same log-probabilities, advantages and masks: tests/test_grpo.py):

    ratio = exp(logp - logp_old)        (1 when each rollout is trained on once: logp_old is logp, detached)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)  [+ beta * KL(policy, reference)]

summed as the loop's unit asks: dapo averages over every completion token of the step (the unit: a token),
grpo each completion's tokens and then over completions, dr_grpo sums a completion's and divides by
max_new_tokens (the unit: a completion). With `num_iterations` > 1 a rollout is trained on for that many
steps, against the log-probabilities it was sampled with (computed once, before its first update); checkpoints
fall between rollouts (the config says so), where a run resumes exactly: a rollout depends only on the weights
and the seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune import attention, shared_attention
from finetune.batch import Batch
from finetune.config import ModelConfig, RLConfig
from finetune.data.pack import with_host_indices
from finetune.data.prompt_only import PromptOnly
from finetune.data.prompts import content_text
from finetune.data.rollout import separate_rows, shared_rows
from finetune.distributed import raised_together
from finetune.generation import (
    Sampling,
    complete,
    cut_short,
    gathers_once,
    generating,
    rollout_decoding,
    row_noise,
    sample_rollout,
    stop_tokens,
)
from finetune.loss import LossPath, token_logps
from finetune.model import disable_dropout, load_model_config
from finetune.rewards import Reward, build_rewards, check_columns, score
from finetune.sequence import gather_rows
from finetune.static_decode import StaticDecoding, check_static_cache
from finetune.wrap import reshard

if TYPE_CHECKING:
    from finetune.objectives import BuildContext

STD_EPSILON = 1e-4
"""Added to the standard deviation that divides advantages (TRL's), so a group of almost equal rewards does not
blow up."""


@dataclass(frozen=True)
class TokenLosses:
    per_token: torch.Tensor
    """(tokens,) each completion token's loss, differentiable."""
    low_clipped: torch.Tensor
    """(tokens,) the ratio fell below 1 - epsilon where the advantage is negative (the clipped side bounds it)."""
    high_clipped: torch.Tensor
    kl: torch.Tensor | None
    """(tokens,) the per-token KL estimate to the reference (beta > 0), detached."""


def token_losses(
    cfg: RLConfig,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sequence: torch.Tensor,
    num_sequences: int,
) -> TokenLosses:
    """Each completion token's loss (and KL penalty), from its log-probability under the policy, at sampling, under
    the reference, its completion's advantage, whether it trains (`mask`) and its completion's number (`sequence`):
    all (tokens,). PPO's clipped surrogate of the token's ratio (grpo, dapo, dr_grpo) or of its completion's (gspo:
    the exponent of the mean log-ratio over the completion's trained tokens, GSPO's); cispo's policy gradient
    weighted by the ratio clipped above and held constant (MiniMax-M1's)."""
    log_ratio = logps - old_logps
    if cfg.loss == "gspo":
        zeros = log_ratio.new_zeros(num_sequences)
        counts = zeros.index_add(0, sequence, mask.to(log_ratio.dtype)).clamp(min=1)
        log_ratio = (zeros.index_add(0, sequence, log_ratio * mask) / counts).index_select(0, sequence)
    ratio = torch.exp(log_ratio)
    if cfg.loss == "cispo":
        # The weight never passes gradient, so a clipped token still trains (PPO's clip would zero it).
        weight = torch.clamp(ratio, max=1 + cfg.upper_epsilon).detach()
        per_token = -weight * advantages * logps
        low = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        clipped = torch.clamp(ratio, 1 - cfg.lower_epsilon, 1 + cfg.upper_epsilon)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        low = (ratio < 1 - cfg.lower_epsilon) & (advantages < 0)
    kl = None
    if cfg.beta:
        # k3, an unbiased estimate of KL(policy || reference) with low variance (Schulman's).
        difference = ref_logps - logps
        kl = torch.exp(difference) - difference - 1
        per_token = per_token + cfg.beta * kl
        kl = kl.detach()
    high = (ratio > 1 + cfg.upper_epsilon) & (advantages > 0)
    return TokenLosses(per_token, low.detach(), high.detach(), kl)


def summed_loss(
    cfg: RLConfig, per_token: torch.Tensor, mask: torch.Tensor, sequence: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """A micro-batch's loss summed over the objective's units (the loop divides by the step's units): dapo and
    cispo, the sum over tokens; grpo and gspo, each completion's mean over its tokens, summed; dr_grpo, each
    completion's sum over max_new_tokens, summed. `mask` (tokens,) is 0 where a token trains nothing, `sequence`
    its completion."""
    masked = per_token * mask
    if cfg.per_token:
        return masked.sum()
    if cfg.loss == "dr_grpo":
        return masked.sum() / cfg.max_new_tokens
    zeros = torch.zeros(num_sequences, dtype=masked.dtype, device=masked.device)
    counts = zeros.index_add(0, sequence, mask.to(masked.dtype))
    return (zeros.index_add(0, sequence, masked) / counts.clamp(min=1)).sum()


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


_BASE = 11
"""The window's sums before the reward functions' (see `_Window.__post_init__`)."""


@dataclass
class _Sampled:
    """A rollout's completions on this process, `num_generations` a prompt in order, with what training needs."""

    prompts: list[list[int]]
    """Each completion's prompt tokens."""
    completions: list[list[int]]
    per_function: torch.Tensor
    """(completions, functions) rewards, NaN where a function scored nothing."""
    truncated: list[bool]
    keys: list[tuple[int, int]]
    """Each group's (round, prompt number): its place in the step, the same on any process count."""
    signal: torch.Tensor
    """(groups,) whether the group's rewards differ."""

    @staticmethod
    def joined(parts: list[_Sampled]) -> _Sampled:
        return _Sampled(
            [p for part in parts for p in part.prompts], [c for part in parts for c in part.completions],
            torch.cat([part.per_function for part in parts]), [t for part in parts for t in part.truncated],
            [k for part in parts for k in part.keys], torch.cat([part.signal for part in parts]),
        )  # fmt: skip

    def groups(self, chosen: list[int], generations: int) -> list[tuple]:
        """The chosen groups' data, a tuple each (what a process sends another)."""
        out = []
        for g in chosen:
            rows = slice(g * generations, (g + 1) * generations)
            out.append((self.prompts[rows], self.completions[rows], self.per_function[rows], self.truncated[rows],
                        self.keys[g], bool(self.signal[g])))  # fmt: skip
        return out

    @staticmethod
    def of_groups(groups: list[tuple]) -> _Sampled:
        return _Sampled(
            [p for g in groups for p in g[0]], [c for g in groups for c in g[1]],
            torch.cat([g[2] for g in groups]), [t for g in groups for t in g[3]], [g[4] for g in groups],
            torch.tensor([g[5] for g in groups]),
        )  # fmt: skip


def _summed(accelerator: Accelerator, values: list[float]) -> list[float]:
    """`values` added up over every process."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(tensor, "sum").cpu().tolist()


def _gathered(accelerator: Accelerator, value: Any) -> list[Any]:
    """Every process's `value` (picklable), in process order."""
    if accelerator.num_processes == 1:
        return [value]
    out: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, value)
    return out


def _dealt(accelerator: Accelerator, sampled: _Sampled, total: int, micro: int, generations: int) -> _Sampled:
    """The step's `total` groups, chosen over every process (those with a reward spread first, each kind in the
    order (round, prompt number)), and this process's share of them: in that order, micro-batches of `micro` groups
    dealt round the processes as the loader deals a step's prompts."""
    processes, me = accelerator.num_processes, accelerator.process_index
    candidates = [(not signal, key) for key, signal in zip(sampled.keys, sampled.signal.tolist(), strict=True)]
    everyone = _gathered(accelerator, candidates)
    ranked = sorted((c, process, n) for process, mine in enumerate(everyone) for n, c in enumerate(mine))
    chosen = sorted(ranked[:total], key=lambda entry: entry[0][1])  # in (round, prompt number) order
    owner = {(process, n): (k // micro) % processes for k, (_, process, n) in enumerate(chosen)}
    place = {(process, n): k for k, (_, process, n) in enumerate(chosen)}
    mine = [n for (process, n) in place if process == me]
    sent = list(zip([(owner[me, n], place[me, n]) for n in mine], sampled.groups(mine, generations), strict=True))
    received = [item for items in _gathered(accelerator, sent) for item in items if item[0][0] == me]
    return _Sampled.of_groups([group for _, group in sorted(received, key=lambda item: item[0][1])])


@dataclass
class _Window:
    """Rollout and loss statistics since the last log, summed on this process (`periodic_metrics` adds them up)."""

    names: tuple[str, ...]
    sums: torch.Tensor = field(init=False)
    longest: float = 0.0
    loss_sums: torch.Tensor | None = None
    """The losses' token counts, on the device they are computed on: summed there, read once per log."""
    generating_seconds: float = 0.0
    """Wall time this process spent generating, and the rollouts it generated, since the last log."""
    rollouts: int = 0

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

    def add_losses(self, mask: torch.Tensor, losses: TokenLosses) -> None:
        kl = (losses.kl * mask).sum() if losses.kl is not None else mask.new_zeros(())
        values = torch.stack([mask.sum(), (losses.low_clipped * mask).sum(), (losses.high_clipped * mask).sum(), kl])
        values = values.detach().double()
        self.loss_sums = values if self.loss_sums is None else self.loss_sums + values

    def metrics(self, accelerator: Accelerator, beta: float) -> dict[str, float]:
        device = accelerator.device
        losses = self.loss_sums if self.loss_sums is not None else torch.zeros(4, dtype=torch.float64, device=device)
        sums = accelerator.reduce(torch.cat([self.sums.to(device), losses.to(device)]), "sum").cpu().tolist()
        # The longest completion, and the slowest process's generation (the others wait for it).
        most = torch.tensor([self.longest, self.generating_seconds], device=device, dtype=torch.float64)
        if accelerator.num_processes > 1:
            torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        longest, seconds = most.tolist()
        rollouts = self.rollouts
        self.sums.zero_()
        self.longest, self.loss_sums, self.generating_seconds, self.rollouts = 0.0, None, 0.0, 0
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
        trained, low, high, kl = sums[-4:]
        values |= {
            "clip_ratio/low_mean": low / max(trained, 1), "clip_ratio/high_mean": high / max(trained, 1),
            "clip_ratio/region_mean": (low + high) / max(trained, 1),
        }  # fmt: skip
        if beta:
            values["kl"] = kl / max(trained, 1)
        return values


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


@dataclass
class GRPO:
    """The `rl` objective (`finetune.objectives.Objective`), with `rollout` answering each step's prompts."""

    cfg: RLConfig
    loss_path: LossPath
    rewards: list[Reward]
    tokenizer: PreTrainedTokenizerBase
    seed: int
    reference: str
    """none (beta 0), adapters (the model with its adapters switched off) or model (a frozen copy of the base)."""
    reference_model: torch.nn.Module | None = None
    gather_once: bool = True
    """Generation keeps every layer's parameters gathered from the first decoding step to the last."""
    static: StaticDecoding | None = None
    """The rollouts' decoding over a static cache (rl.rollout_cache: static), kept for the run: its compiled steps."""
    share_prompts: bool = False
    """The models attend with `shared_prompt` attention: a prompt's completions share its row (`finetune.data.rollout`:
    never more positions than a row each); else a row each."""
    window: _Window = field(init=False)
    cached: tuple[int, list[Batch]] | None = None
    """The rollout trained on again (num_iterations > 1): the step it was sampled at, and its micro-batches."""
    metric_names: tuple[str, ...] = ()
    progress_name: str | None = None

    def __post_init__(self) -> None:
        self.window = _Window(tuple(reward.name for reward in self.rewards))

    @property
    def unit_name(self) -> str:
        return "completion_tokens" if self.cfg.per_token else "completions"

    @property
    def steps_per_window(self) -> int:
        return self.cfg.num_iterations

    def count(self, batch: Batch) -> torch.Tensor:
        if self.cfg.per_token:
            return batch["token_mask"].sum().double()
        return torch.tensor(float(batch["advantages"].shape[0]), dtype=torch.float64)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logps = token_logps(model, batch, self.loss_path, self.cfg.temperature)
        old = batch.get("old_logps")
        device = logps.device
        sequence, mask = batch["token_sequence"].to(device), batch["token_mask"].to(device)
        completions = batch["advantages"].shape[0]
        losses = token_losses(
            self.cfg, logps, old.to(device) if old is not None else logps.detach(),
            batch["ref_logps"].to(device) if "ref_logps" in batch else None,
            batch["advantages"].to(device).index_select(0, sequence), mask, sequence, completions,
        )  # fmt: skip
        self.window.add_losses(mask, losses)
        summed = summed_loss(self.cfg, losses.per_token, mask, sequence, completions)
        return summed, torch.zeros(0)

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        return self.window.metrics(accelerator, self.cfg.beta)

    def rollout(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        step: int,
        accelerator: Accelerator,
        draw: Callable[[], list[Batch]] | None = None,
    ) -> list[Batch]:
        """The step's micro-batches of prompts answered, scored and made micro-batches of completions (collective:
        every process generates at once). With dynamic sampling, groups whose rewards all tie are replaced by those
        of more prompts (`draw`: the loader's next window, on every process at once). A rollout trained on again
        (num_iterations) is returned as it was."""
        first_step = step - (step - 1) % self.cfg.num_iterations
        if self.cached is not None and self.cached[0] == first_step:
            return self.cached[1]
        generations = self.cfg.num_generations
        sampled = self._sample(model, micro_batches, first_step, 0, accelerator)
        if self.cfg.dynamic_sampling_rounds and draw is not None:
            micro = len(micro_batches[0]["prompt_ids"])
            sampled = self._refilled(model, sampled, draw, first_step, micro, accelerator)
        moments = lambda values: accelerator.reduce(values.to(accelerator.device), "sum").cpu()  # noqa: E731
        advantage, _, _ = advantages(sampled.per_function, self._weights, generations, self.cfg.scale_rewards, moments)
        batches, start = [], 0
        for batch in micro_batches:
            rows = len(batch["prompt_ids"]) * generations
            batches.append(self._completion_batch(
                sampled.prompts[start : start + rows], sampled.completions[start : start + rows],
                advantage[start : start + rows], sampled.truncated[start : start + rows],
            ))  # fmt: skip
            start += rows
        self._add_log_probabilities(model, batches, accelerator)
        self.cached = (first_step, batches) if self.cfg.num_iterations > 1 else None
        return batches

    def _sample(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        first_step: int,
        round_: int,
        accelerator: Accelerator,
    ) -> _Sampled:
        """Micro-batches of prompts answered `num_generations` times each and scored (collective), counted in the
        window. A prompt's noise is seeded by its number, the step and the round (0 for the step's own prompts)."""
        generations = self.cfg.num_generations
        prompts = [ids for batch in micro_batches for ids in batch["prompt_ids"] for _ in range(generations)]
        indices = [int(i) for batch in micro_batches for i in batch["prompt_index"]]
        seeds = [
            (self.seed, first_step, index, n) + ((round_,) if round_ else ())
            for index in indices for n in range(generations)
        ]  # fmt: skip
        sampling = Sampling(self.cfg.temperature, self.cfg.top_p, row_noise(seeds, self.cfg.max_new_tokens))
        began = time.perf_counter()
        new_tokens, once = self.cfg.max_new_tokens, self.gather_once
        completions = sample_rollout(
            model, prompts, self.tokenizer, accelerator, new_tokens, sampling, once, generations, self.static
        )
        seconds = time.perf_counter() - began
        truncated = cut_short(completions, stop_tokens(model, self.tokenizer))  # cut at max_new_tokens
        per_function = raised_together(accelerator, self._score, micro_batches, completions, generations)
        _, rewards, no_signal = advantages(per_function, self._weights, generations, "group")
        lengths = [len(c) for c in completions]
        self.window.add_rollout(rewards, per_function, lengths, truncated, no_signal, generations, seconds)
        signal = ~no_signal.view(-1, generations)[:, 0]
        return _Sampled(prompts, completions, per_function, truncated, [(round_, i) for i in indices], signal)

    def _refilled(
        self,
        model: torch.nn.Module,
        sampled: _Sampled,
        draw: Callable[[], list[Batch]],
        first_step: int,
        micro: int,
        accelerator: Accelerator,
    ) -> _Sampled:
        """Dynamic sampling (DAPO's): while fewer groups of the step have a reward spread than it trains, and at
        most rl.dynamic_sampling_rounds times, another window of prompts is drawn and answered; then the step trains
        the groups with signal first, in the order (round, prompt number), the rest filled by groups without: the
        same groups on any process count, dealt to the processes as the loader deals prompts."""
        groups = len(sampled.keys)
        total = int(_summed(accelerator, [groups])[0])
        rounds = [sampled]
        while True:
            with_signal = int(_summed(accelerator, [sum(int(r.signal.sum()) for r in rounds)])[0])
            if with_signal >= total or len(rounds) > self.cfg.dynamic_sampling_rounds:
                break
            rounds.append(self._sample(model, draw(), first_step, len(rounds), accelerator))
        merged = _Sampled.joined(rounds)
        kept = _dealt(accelerator, merged, total, micro, self.cfg.num_generations)
        self.window.add_refill(groups, len(merged.keys) - groups, with_signal < total)
        return kept

    @property
    def _weights(self) -> torch.Tensor:
        return torch.tensor([reward.weight for reward in self.rewards])

    def _score(self, micro_batches: list[Batch], completions: list[list[int]], repeats: int) -> torch.Tensor:
        """Rewards per completion and function, each function called once with every completion given; each
        prompt's columns repeated for its `repeats` completions."""
        columns: dict[str, list[Any]] = {}
        for batch in micro_batches:
            for name, values in batch["columns"].items():
                columns.setdefault(name, []).extend(v for v in values for _ in range(repeats))
        prompts = columns.pop("prompt")
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        # As TRL gives them: conversations' completions as an assistant message (a prefill's text, the prompt's last
        # assistant message, before what the model wrote, and no longer in the prompt), text prompts' as text.
        given = []
        for n, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
            if isinstance(prompt, list):
                prefill = content_text(prompt[-1].get("content")) if prompt[-1].get("role") == "assistant" else None
                if prefill is not None:
                    prompts[n] = prompt[:-1]
                given.append([{"role": "assistant", "content": (prefill or "") + text}])
            else:
                given.append(text)
        return score(self.rewards, prompts, given, completions, columns)

    def _completion_batch(
        self, prompts: list[list[int]], completions: list[list[int]], advantage: torch.Tensor, truncated: list[bool]
    ) -> Batch:
        """The completions as training rows (`finetune.data.rollout`): each prompt shared by its completions where
        the model's attention can, else a row per completion; the completions' tokens are the targets, in the same
        order either way."""
        pad, group = self.tokenizer.pad_token_id, self.cfg.num_generations
        if self.share_prompts:
            rows = shared_rows(prompts, completions, group, pad)
        else:
            rows = separate_rows(prompts, completions, pad)
        token_sequence = [n for n, completion in enumerate(completions) for _ in completion]
        masked = [self.cfg.mask_truncated and cut for cut in truncated]
        token_mask = [0.0 if masked[n] else 1.0 for n in token_sequence]
        batch: Batch = {
            **rows, "num_tokens": rows["attention_mask"].sum(), "advantages": advantage.float(),
            "token_sequence": torch.tensor(token_sequence), "token_mask": torch.tensor(token_mask),
        }  # fmt: skip
        return with_host_indices(batch)

    @torch.no_grad()
    def _add_log_probabilities(self, model: torch.nn.Module, batches: list[Batch], accelerator: Accelerator) -> None:
        """What the loss compares with, computed once per rollout: the log-probabilities at sampling (when a rollout
        is trained on more than once) and the reference's (beta > 0)."""
        device = accelerator.device
        for n, batch in enumerate(batches):
            batches[n] = batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            if self.cfg.num_iterations > 1:
                batch["old_logps"] = token_logps(model, batch, self.loss_path, self.cfg.temperature)
            if self.reference == "model":
                batch["ref_logps"] = token_logps(self.reference_model, batch, self.loss_path, self.cfg.temperature)
            elif self.reference == "adapters":
                from finetune.adapters import adapters_disabled

                with adapters_disabled(model):
                    batch["ref_logps"] = token_logps(model, batch, self.loss_path, self.cfg.temperature)
        if self.cfg.num_iterations > 1 or self.reference != "none":
            reshard(model)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """The held-out prompts answered greedily, once each: the mean reward (and each function's, over the
        completions it scored) and completion length, each prompt counted once whatever the process count."""
        model.eval()
        sums = torch.zeros(2 + 2 * len(self.rewards), dtype=torch.float64)
        count = 0
        with generating(model, gather_once=self.gather_once) as lock_step:
            for batch in loader:
                completions = complete(
                    model, batch["prompt_ids"], self.tokenizer, accelerator, self.cfg.max_new_tokens,
                    lock_step=lock_step,
                )  # fmt: skip
                per_function = raised_together(accelerator, self._score, [batch], completions, 1)
                reward = (per_function * self._weights).nansum(dim=1, keepdim=True)
                length = torch.tensor([[len(c)] for c in completions], dtype=torch.float32)
                scored = (~torch.isnan(per_function)).float()
                rows = torch.cat([reward, length, torch.nan_to_num(per_function), scored], dim=1)
                # Without the prompts accelerate repeated to give every process equal batches.
                (rows,) = gather_rows(accelerator, (rows.to(accelerator.device),))
                sums += rows.double().sum(dim=0).cpu()
                count += rows.shape[0]
        model.train()
        total, length, *per_function = (sums / max(count, 1)).tolist()
        # Named as the rollouts' length, apart from eval.generate's completion_tokens (its own prompts and limit).
        values = {"reward": total, "completions/mean_length": length}
        functions = len(self.rewards)
        scored_share = per_function[functions:]
        for reward, mean, share in zip(self.rewards, per_function[:functions], scored_share, strict=True):
            values[f"rewards/{reward.name}"] = mean / share if share else math.nan
        return values


class GRPOBuilder:
    """Online RL as the build knows it (`finetune.objectives.ObjectiveBuilder`): prompts, dropout off, the rewards
    imported and checked at once, and the reference the KL penalty compares with (beta > 0)."""

    name = "rl"
    unit_noun = "prompts"
    reference_setting = "model.name_or_path (the KL penalty's reference)"

    def __init__(self, cfg: RLConfig, model: ModelConfig, adapters: bool):
        self.cfg = cfg
        # Before anything loads: an import error is found in seconds, a cache the model's layers cannot use too.
        if cfg.rollout_cache == "static":
            check_static_cache(load_model_config(model), model.name_or_path)
        base = model.name_or_path
        self.rewards = build_rewards(cfg.rewards, cfg.max_new_tokens)
        self.samples = PromptOnly(
            cfg.max_new_tokens, lambda columns, where: check_columns(self.rewards, columns, where)
        )
        self.reference = "none" if not cfg.beta else "adapters" if adapters else "model"
        self.reference_model = base if self.reference == "model" else None

    def prepare_model(self, model: torch.nn.Module, accelerator: Accelerator) -> None:
        dropped = disable_dropout(model)  # sampled, scored and trained on as one and the same policy
        if dropped:
            accelerator.print(f"dropout: off for online RL ({dropped})")

    def build(self, context: BuildContext) -> tuple[GRPO, Callable[[], None]]:
        accelerator = context.accelerator
        model = accelerator.unwrap_model(context.model)
        once, line = gathers_once(model, accelerator)
        accelerator.print(line)
        static, line = rollout_decoding(self.cfg.rollout_cache, model, accelerator)
        accelerator.print(line)
        objective = GRPO(
            self.cfg, context.loss_path, self.rewards, context.tokenizer, context.recipe.train.seed, self.reference,
            gather_once=once, static=static,
        )  # fmt: skip
        if self.reference == "model":
            from finetune.reference import frozen_model

            objective.reference_model = frozen_model(context.recipe.model, self.reference_model, accelerator,
                                                     "rl.beta > 0: the initial weights")  # fmt: skip
        models = [model] + ([accelerator.unwrap_model(objective.reference_model)] if objective.reference_model else [])
        objective.share_prompts, line = _share_prompts(models)
        accelerator.print(line)
        return objective, lambda: None


def _share_prompts(models: list[torch.nn.Module]) -> tuple[bool, str]:
    """Whether rollout rows may share their prompt (its attention, `shared_prompt`, set on the models: the policy
    and a frozen reference, which score the same rows), and the log's line saying which."""
    implementation = models[0].config._attn_implementation
    # varlen and flash kernels take sample boundaries, no grouping; shared_attention knows full causal attention only.
    why = (
        f"{implementation} attention" if implementation != "sdpa"
        else attention.unsupported(models[0].config)
    )  # fmt: skip
    if why is not None:
        return False, f"rollout rows: one per completion (shared prompts need SDPA's full causal attention: {why})"
    shared_attention.register()
    for model in models:
        model.set_attn_implementation(shared_attention.NAME)
    return True, "rollout rows: each prompt once, its completions after it (shared_prompt attention)"
