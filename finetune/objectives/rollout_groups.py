"""A rollout's groups (a prompt and its completions) as one process holds them, and dynamic sampling's dealing of
them: the step's groups chosen over every process (those with a reward spread first, in the order (round, prompt
number)) and sent to the process the loader would have dealt their prompts to, so that the same groups train on
any process count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator


@dataclass
class Sampled:
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
    wrote: list[list[int]]
    """Per completion token, 1 where the model sampled it (0: a tool's answer in an episode, context only)."""

    @staticmethod
    def joined(parts: list[Sampled]) -> Sampled:
        return Sampled(
            [p for part in parts for p in part.prompts], [c for part in parts for c in part.completions],
            torch.cat([part.per_function for part in parts]), [t for part in parts for t in part.truncated],
            [k for part in parts for k in part.keys], torch.cat([part.signal for part in parts]),
            [w for part in parts for w in part.wrote],
        )  # fmt: skip

    def groups(self, chosen: list[int], generations: int) -> list[tuple]:
        """The chosen groups' data, a tuple each (what a process sends another)."""
        out = []
        for g in chosen:
            rows = slice(g * generations, (g + 1) * generations)
            out.append((self.prompts[rows], self.completions[rows], self.per_function[rows], self.truncated[rows],
                        self.keys[g], bool(self.signal[g]), self.wrote[rows]))  # fmt: skip
        return out

    @staticmethod
    def of_groups(groups: list[tuple]) -> Sampled:
        return Sampled(
            [p for g in groups for p in g[0]], [c for g in groups for c in g[1]],
            torch.cat([g[2] for g in groups]), [t for g in groups for t in g[3]], [g[4] for g in groups],
            torch.tensor([g[5] for g in groups]), [w for g in groups for w in g[6]],
        )  # fmt: skip


def summed_over_processes(accelerator: Accelerator, values: list[float]) -> list[float]:
    """`values` added up over every process."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(tensor, "sum").cpu().tolist()


def gathered_objects(accelerator: Accelerator, value: Any) -> list[Any]:
    """Every process's `value` (picklable), in process order."""
    if accelerator.num_processes == 1:
        return [value]
    out: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, value)
    return out


def dealt(accelerator: Accelerator, sampled: Sampled, total: int, micro: int, generations: int) -> Sampled:
    """The step's `total` groups, chosen over every process (those with a reward spread first, each kind in the
    order (round, prompt number)), and this process's share of them: in that order, micro-batches of `micro` groups
    dealt round the processes as the loader deals a step's prompts."""
    processes, me = accelerator.num_processes, accelerator.process_index
    candidates = [(not signal, key) for key, signal in zip(sampled.keys, sampled.signal.tolist(), strict=True)]
    everyone = gathered_objects(accelerator, candidates)
    ranked = sorted((c, process, n) for process, mine in enumerate(everyone) for n, c in enumerate(mine))
    chosen = sorted(ranked[:total], key=lambda entry: entry[0][1])  # in (round, prompt number) order
    owner = {(process, n): (k // micro) % processes for k, (_, process, n) in enumerate(chosen)}
    place = {(process, n): k for k, (_, process, n) in enumerate(chosen)}
    mine = [n for (process, n) in place if process == me]
    sent = list(zip([(owner[me, n], place[me, n]) for n in mine], sampled.groups(mine, generations), strict=True))
    received = [item for items in gathered_objects(accelerator, sent) for item in items if item[0][0] == me]
    return Sampled.of_groups([group for _, group in sorted(received, key=lambda item: item[0][1])])
