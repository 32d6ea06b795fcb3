"""Online RL's rewards (`rl.rewards`): what scores a sampled completion, as TRL's reward functions do.

A reward is a built-in or a function of your own, called once per rollout with every completion of the process:

    function(prompts=[...], completions=[...], completion_ids=[...], **columns) -> [float | None, ...]

`prompts` as the data holds them (text, or a list of messages); `completions` as text for text prompts and as
`[{"role": "assistant", "content": text}]` for conversations; every other column of the data by its name, one
value per completion. None leaves a completion unscored by that function (its group's baseline ignores it).
Built-ins: `exact_match` (the completion, or what `pattern` extracts from it, equals the `column`'s value, both
stripped), `regex` (1.0 when the completion matches `pattern` whole) and `overlong` (DAPO's soft penalty, 0 to -1
over the last `cache` tokens before `rl.max_new_tokens`).

Imports and signatures are checked before anything loads; the columns a reward reads, once the data is read.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from finetune.config import RewardConfig
from finetune.errors import FinetuneError, first_line, imported

if TYPE_CHECKING:
    import datasets

ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every reward function is given besides the data's columns."""

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""Rewards are summed and normalized in float32: a larger value would become infinite there."""


@dataclass(frozen=True)
class Reward:
    name: str
    weight: float
    function: Callable[..., Sequence[float | None]]
    column: str | None
    """The data column a built-in reads, checked against the data."""


ENVIRONMENT_REWARDS = "environment_rewards"
"""The keyword an episode's environment reward (its `get_reward`) reaches the reward functions by."""


def environment_reward(name: str) -> Reward:
    """The environments' own reward (agents'), named after their class, with weight 1 as TRL gives it."""

    def environment(**columns: Any) -> list[float | None]:
        return columns[ENVIRONMENT_REWARDS]

    return Reward(name, 1.0, environment, None)


EPISODE_ENDS = "episode_ends"
"""The keyword each episode's end (`finetune.rollouts.episodes.ENDS`) reaches the rewards by."""


def unfinished_reward(value: float) -> Reward:
    """rl.unfinished_reward: `value` for an episode that ended without an answer, nothing for the others (whose
    rewards the functions give); `unfinished_only` leaves the unfinished ones to it alone."""

    def unfinished(**columns: Any) -> list[float | None]:
        return [None if end == "answer" else value for end in columns[EPISODE_ENDS]]

    return Reward("unfinished", 1.0, unfinished, None)


def unfinished_only(per_function: torch.Tensor, ends: list[str], names: list[str]) -> torch.Tensor:
    """(completions, functions) scores where an unfinished episode keeps only the `unfinished` reward's."""
    column = names.index("unfinished")
    rows = torch.tensor([end != "answer" for end in ends])
    others = torch.ones(len(names), dtype=torch.bool)
    others[column] = False
    per_function[rows.unsqueeze(1) & others] = math.nan
    return per_function


def build_rewards(
    configs: list[RewardConfig],
    max_new_tokens: int | None = None,
    learned: Callable[[RewardConfig], Callable[..., Sequence[float | None]]] | None = None,
) -> list[Reward]:
    """The recipe's rewards, imported and checked (one message naming the fix for each kind of mistake);
    `max_new_tokens`, the completions' limit, is what `overlong` measures against; `learned` makes the function of
    an entry that names a reward model (`finetune.objectives.learned_reward`)."""
    rewards = []
    for cfg in configs:
        if cfg.model is not None:
            if learned is None:
                raise ValueError("build_rewards: a reward model's entry needs `learned`")
            rewards.append(Reward(cfg.name, cfg.weight, learned(cfg), None))
        elif cfg.function == "overlong":
            if max_new_tokens is None:
                raise ValueError("build_rewards: overlong needs the completions' limit, max_new_tokens")
            rewards.append(Reward(cfg.name, cfg.weight, _overlong(max_new_tokens, cfg.cache or 0), None))
        elif cfg.function == "exact_match":
            column = cfg.column or "answer"
            rewards.append(Reward(cfg.name, cfg.weight, _exact_match(column, cfg.pattern), column))
        elif cfg.function == "regex":
            rewards.append(Reward(cfg.name, cfg.weight, _regex(cfg.pattern or ""), None))
        else:
            rewards.append(Reward(cfg.name, cfg.weight, _imported(cfg.function), None))
    names = [reward.name for reward in rewards]
    if len(set(names)) < len(names):
        raise FinetuneError(
            f"rl.rewards names {', '.join(names)}: two have one name, and each is logged by its name; "
            "give one a label of its own (rl.rewards: [{function: ..., label: ...}])"
        )
    return rewards


def check_columns(rewards: list[Reward], columns: Sequence[str], where: str) -> None:
    """A built-in's column, or a function's required keyword argument, missing from the data; a column named like
    an argument every function is given."""
    clashing = [name for name in ARGUMENTS if name in columns]
    if clashing:
        raise FinetuneError(
            f"{where} has a column named {', '.join(clashing)}, as the argument{'s' * (len(clashing) > 1)} every "
            f"reward function is given; rename {'them' if len(clashing) > 1 else 'it'} with the source's columns "
            "mapping (e.g. columns: {" + f"{clashing[0]}_given: {clashing[0]}" + "})"
        )
    for reward in rewards:
        if reward.column is not None and reward.column not in columns:
            raise FinetuneError(
                f"rl.rewards: {reward.name} compares with column {reward.column!r}, which {where} lacks (columns: "
                f"{', '.join(columns)}); set its column to one of them"
            )
        missing = [name for name in _required(reward.function) if name not in (*ARGUMENTS, *columns)]
        if missing:
            raise FinetuneError(
                f"rl.rewards: {reward.name} requires {', '.join(missing)}, which {where} lacks as columns (columns: "
                f"{', '.join(columns)}); give the argument a default or add the column"
            )


def unscored(rewards: list[Reward], prompts: datasets.Dataset) -> list[str]:
    """What the data leaves unscored, said once when it is read: rows whose column a built-in compares with is null
    (their completions get no score from it, as `exact_match` scores None against nothing, not 0)."""
    notes = []
    for reward in rewards:
        if reward.column is not None and reward.column in prompts.column_names:
            nulls = sum(value is None for value in prompts[reward.column])
            if nulls:
                notes.append(f"{nulls:,} with a null {reward.column}, left unscored by {reward.name}")
    return notes


def score(
    rewards: list[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> torch.Tensor:
    """(completions, rewards) float32 scores, NaN where a function returned None."""
    scores = torch.empty(len(completions), len(rewards), dtype=torch.float32)
    for n, reward in enumerate(rewards):
        try:
            values = reward.function(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
            )
        except Exception as exc:
            raise FinetuneError(
                f"rl.rewards: {reward.name} raised {type(exc).__name__}: {first_line(exc)}; fix the function (it is "
                "called with prompts, completions, completion_ids and the data's columns as keyword arguments)"
            ) from exc
        values = _values(values, reward.name, len(completions))
        for i, value in enumerate(values):
            scores[i, n] = _value(value, reward.name, i)
    return scores


def _values(values: Any, name: str, count: int) -> list[Any]:
    """What a reward function returned, as one value per completion (a list, tuple, array or tensor of them)."""
    if (
        isinstance(values, str | bytes | Mapping)
        or not isinstance(values, Iterable)
        or getattr(values, "ndim", 1) != 1
    ):
        raise FinetuneError(
            f"rl.rewards: {name} returned {_shown(values)}, not a list; return a list of one float (or None) per "
            f"completion ({count} here)"
        )
    values = list(values)
    if len(values) != count:
        raise FinetuneError(
            f"rl.rewards: {name} returned {len(values)} values for {count} completions; return one float (or None) "
            "per completion"
        )
    return values


def _value(value: Any, name: str, index: int) -> float:
    """One completion's reward as float32 takes it: any real number (Python's, numpy's, a 0-d array or tensor),
    or NaN for None (not scored)."""
    if value is None:
        return math.nan
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) <= FLOAT32_MAX:
        return float(value)
    too_large = isinstance(value, numbers.Real) and math.isfinite(value)
    raise FinetuneError(
        f"rl.rewards: {name} returned {_shown(value)} for completion {index}; return a finite real number"
        f"{f' within float32 range (±{FLOAT32_MAX:.3g})' if too_large else ''}, or None to leave a completion unscored"
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def completion_text(completion: Any) -> str:
    """A completion's text, whether given as text or as messages: the last assistant message's (an episode's
    final answer)."""
    if isinstance(completion, list):
        replies = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        return str(replies[-1].get("content") or "") if replies else ""
    return str(completion)


def _exact_match(column: str, pattern_text: str | None) -> Callable[..., list[float | None]]:
    pattern = re.compile(pattern_text, re.DOTALL) if pattern_text else None

    def exact_match(completions: list[Any], **columns: list[Any]) -> list[float | None]:
        scores = []
        for completion, reference in zip(completions, columns[column], strict=True):
            text = completion_text(completion)
            if pattern is not None:
                found = pattern.findall(text)
                text = (found[-1][0] if isinstance(found[-1], tuple) else found[-1]) if found else None
            if reference is None:  # no answer to compare with: unscored, not wrong
                scores.append(None)
            else:
                scores.append(float(text is not None and text.strip() == str(reference).strip()))
        return scores

    return exact_match


def _overlong(limit: int, cache: int) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment: 0 up to `limit - cache` tokens, then falling linearly to -1 at `limit`
    (the completion's stop token counted, as it is trained); past it (not sampled here, given data) -1."""
    free = limit - cache

    def overlong(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / cache) for ids in completion_ids]

    return overlong


def _regex(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern, re.DOTALL)

    def regex(completions: list[Any], **_: Any) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    return regex


def _imported(name: str) -> Callable[..., Sequence[float | None]]:
    found = imported(name, "rl.rewards", "a function")
    try:
        parameters = inspect.signature(found).parameters.values()
    except (TypeError, ValueError):
        return found  # a builtin without a signature: its first call says whether it takes the arguments
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    positional_only = [
        p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty
    ]
    if positional_only or not (takes_any or "completions" in {p.name for p in parameters}):
        raise FinetuneError(
            f"rl.rewards: {name} takes ({', '.join(p.name for p in parameters)}); a reward function is called with "
            "keyword arguments: define it as def f(completions, **kwargs) (prompts, completion_ids and the data's "
            "columns come as keywords)"
        )
    return found


def _required(function: Callable[..., Any]) -> list[str]:
    """The keyword arguments a function cannot do without (no default, not *args/**kwargs)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in kinds and p.default is p.empty]
