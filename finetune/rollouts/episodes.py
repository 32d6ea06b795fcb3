"""Episodes: completions that call tools (online RL's agents, `rl.tools` / `rl.environment_factory`).

An episode is what follows its prompt: the model's turns, each sampled until the model ends it (a stop token: its
end of turn, or the end marker of a turn of calls), and between them the answers to the calls it made. A turn's
calls are read with the template's own format (`finetune.rollouts.tool_calls`), run (`finetune.rollouts.tools`),
and their results written as the template writes `tool` messages through the next generation prompt; the model
goes on from there with the KV cache it has: nothing is re-rendered or re-tokenized, so the episode's ids are the
ids the model sampled and the ids it read, in the context it read them. Its training row is the prompt and those
ids; the trained positions are the ones the model wrote (`Episode.wrote`).

An episode ends when the model ends a turn without a call (`answer`), when a turn's calls cannot be read at all
(`unread`), after `rl.max_turns` turns (`turns`), or when its ids reach `rl.max_new_tokens` (`length`: every id
after the prompt counts, the tools' answers too, as they take the KV cache's room; an answer that does not fit
ends it there).

Decoding (`play`) is the dynamic cache's loop of `finetune.rollouts.generation`, with rows that feed more than one
id at a step: a row whose turn ended feeds its last sampled token and the answer at once (left-padded within the
step; padding is masked). That padding takes the cache's room in every other row: when it would exceed half an
episode's room (the longest prompt and the budget), the cache is rebuilt from the ids each row holds, without it
(one forward, as a prompt's), so a cache never holds more than one and a half times its rows' longest context.
Each sampled id draws the row's uniform number at its place in the episode, so an episode is the same whatever
else shares its batch or process. Under FSDP the processes decode in lock-step, a process with nothing left
decoding an unrecorded row, as in `complete`. Tools run while decoding waits, all the calls of a step's turns at
once: a tool's time is the step's, and results never depend on which finishes first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel
from transformers import DynamicCache, PreTrainedTokenizerBase

from finetune.data.prompt_only import offered_tools
from finetune.data.prompts import content_text, prompt_tokens
from finetune.engine.processes import raised_together
from finetune.errors import FinetuneError, first_line
from finetune.rollouts.generation import (
    Sampling,
    generating,
    left_padded,
    picker,
    prefilled,
    shared_prompts_cache,
)
from finetune.rollouts.tool_calls import Call, ToolTemplate
from finetune.rollouts.tools import EnvironmentFactory, Outcome, Tool, close_environments, run_calls

ENDS = ("answer", "unread", "turns", "length")
"""How an episode may end (see the module's docstring)."""


@dataclass
class Episode:
    """One completion as an episode: its ids after the prompt, which the model wrote, and what happened."""

    prompt: list[int]
    tools: dict[str, Tool]
    schemas: list[dict[str, Any]]
    """What the model was offered (the prompt rendered with these): the episode's calls may name these only."""
    environment: Any = None
    ids: list[int] = field(default_factory=list)
    wrote: list[int] = field(default_factory=list)
    """1 where the model sampled the id, 0 where it read it (the tools' answers and the template's text)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The episode as chat messages: assistant turns (with their tool_calls) and tool results, as TRL's rewards take
    a conversation's completion."""
    turn_start: int = 0
    tool_seconds: float = 0.0
    """What its calls took so far (a turn's calls run at once: its slowest)."""
    end: str = ""
    environment_reward: float | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("turns", "calls", "error", "unknown",
                                                                         "timeout", "unread"), 0))  # fmt: skip

    @property
    def model_ids(self) -> list[int]:
        """The ids the model wrote, in order."""
        return [i for i, w in zip(self.ids, self.wrote, strict=True) if w]


@dataclass
class Agent:
    """What plays a run's episodes: the template's calls and results, the tools and environment, the limits."""

    tokenizer: PreTrainedTokenizerBase
    template: ToolTemplate
    tools: list[Tool]
    environment: EnvironmentFactory | None
    max_turns: int
    timeout: float
    stops: list[int]
    """The ids that end a model's turn."""
    episode_timeout: float | None = None
    """Seconds an episode's calls may take in all (`rl.episode_timeout`; None: each call's `timeout` only)."""
    waited: float = 0.0
    """Seconds decoding waited for calls since the caller last reset it."""

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """What every prompt offers: the run's tools, then the environment's methods."""
        methods = [] if self.environment is None else self.environment.schemas
        return [tool.schema for tool in self.tools] + methods

    def begin(self, prompts: list[list[int]], rows: list[dict[str, Any]], group: int) -> list[Episode]:
        """An episode per prompt (each `group` in a row alike), its environment reset with its row: the prompt
        re-rendered with the text reset returns (the same for every episode of a prompt, which share it)."""
        episodes: list[Episode] = []
        try:
            for ids, row in zip(prompts, rows, strict=True):
                tools = {tool.name: tool for tool in self.tools}
                columns = {name: value for name, value in row.items() if name != "prompt_index"}  # the data's own
                instance, text = (None, None) if self.environment is None else self.environment.started(columns)
                episodes.append(Episode(ids, tools, self.schemas, instance))
                if instance is not None:
                    tools |= {tool.name: tool for tool in self.environment.tools(instance)}
                if text:
                    episodes[-1].prompt = observed_prompt(row, text, self.tokenizer, self.schemas)
        except BaseException:
            self.end(episodes)  # those already started are closed
            raise
        for start in range(0, len(episodes), group):
            if len({tuple(e.prompt) for e in episodes[start : start + group]}) > 1:
                self.end(episodes)
                raise FinetuneError(
                    f"rl.environment_factory={self.environment.name}: reset returned different text for the episodes "
                    "of one prompt; they share their prompt (a group's completions are compared): make reset's text "
                    "depend on the row alone"
                )
        return episodes

    def end(self, episodes: list[Episode]) -> list[float | None]:
        """Each episode's environment's reward (None without one), kept as its `environment_reward`; each
        environment closed, whatever happens."""
        rewards: list[float | None] = []
        try:
            for episode in episodes:
                rewarded = episode.environment is not None and self.environment.rewarded
                episode.environment_reward = self._reward(episode) if rewarded else None
                rewards.append(episode.environment_reward)
        finally:
            close_environments([e.environment for e in episodes if e.environment is not None])
        return rewards

    def _reward(self, episode: Episode) -> Any:
        try:
            return episode.environment.get_reward()
        except Exception as exc:
            raise FinetuneError(
                f"rl.environment_factory={self.environment.name}: get_reward raised {type(exc).__name__}: "
                f"{first_line(exc)}; fix the environment (it is called once an episode has ended)"
            ) from None

    def answers(self, episodes: list[Episode]) -> list[list[int] | None]:
        """Each episode whose model turn just ended: the ids answering its calls, or None where it ends here."""
        pending: list[tuple[int, list[Call]]] = []
        out: list[list[int] | None] = [None] * len(episodes)
        for n, episode in enumerate(episodes):
            calls = self._turn(episode)
            if calls:
                pending.append((n, calls))
        began = time.monotonic()
        turns = run_calls([(calls, episodes[n].tools, self._time_left(episodes[n])) for n, calls in pending])
        self.waited += time.monotonic() - began
        for (n, calls), (results, took) in zip(pending, turns, strict=True):
            episodes[n].tool_seconds += took
            out[n] = self._answer(episodes[n], calls, results)
        return out

    def _time_left(self, episode: Episode) -> float:
        """The seconds each of the episode's next calls may take."""
        if self.episode_timeout is None:
            return self.timeout
        return min(self.timeout, self.episode_timeout - episode.tool_seconds)

    def _turn(self, episode: Episode) -> list[Call]:
        """The model's turn just ended, read: its message recorded, its calls (none where the episode ends)."""
        turn = episode.ids[episode.turn_start :]
        episode.counts["turns"] += 1
        written = self.tokenizer.decode(turn, skip_special_tokens=False)
        calls, unread = self.template.calls.read(written, episode.schemas)
        episode.counts["unread"] += unread
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        episode.messages.append(message)
        if not calls:
            episode.end = "unread" if unread else "answer"
        elif episode.counts["turns"] >= self.max_turns:
            episode.end = "turns"
        return calls if not episode.end else []

    def _answer(self, episode: Episode, calls: list[Call], results: list[Outcome]) -> list[int]:
        episode.counts["calls"] += len(calls)
        for call, result in zip(calls, results, strict=True):
            if result.error is not None:
                episode.counts[result.error] += 1
            episode.messages.append({"role": "tool", "name": call.name, "content": result.text})
        text = self.template.results_text(calls, [r.text for r in results], episode.schemas)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def observed_prompt(
    row: dict[str, Any], text: str, tokenizer: PreTrainedTokenizerBase, schemas: list[Any]
) -> list[int]:
    """A prompt's tokens with an environment's text appended to its last user message (or to a text prompt)."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = prompt + text
    else:
        last = max(n for n, m in enumerate(prompt) if m.get("role") == "user")
        prompt = [*prompt[:last], {**prompt[last], "content": content_text(prompt[last].get("content")) + text},
                  *prompt[last + 1 :]]  # fmt: skip
    index = int(row.get("prompt_index", -1))
    return prompt_tokens(prompt, offered_tools(row.get("tools"), schemas, index), tokenizer, index)


def sample_episodes(
    model: torch.nn.Module,
    agent: Agent,
    prompts: list[list[int]],
    rows: list[dict[str, Any]],
    accelerator: Accelerator,
    budget: int,
    sampling: Sampling | None,
    gather_once: bool,
    group: int,
) -> list[Episode]:
    """The prompts' episodes played (a collective, as `sample_rollout`: the model in eval mode without gradients,
    inside `generating`), each given its environment's reward; every environment closed, whatever happens."""
    episodes = raised_together(accelerator, agent.begin, prompts, rows, group)
    was_training = model.training
    model.eval()
    try:
        generator = model.module if isinstance(model, DistributedDataParallel) else model
        with torch.no_grad(), generating(model, gather_once=gather_once) as lock_step:
            synced = lock_step and accelerator.num_processes > 1
            play(generator, episodes, agent, agent.tokenizer.pad_token_id, budget, sampling, synced, group)
    except BaseException:
        close_environments([e.environment for e in episodes if e.environment is not None])
        raise
    model.train(was_training)
    # An environment's error stops every process with its message, not only the one it happened on.
    raised_together(accelerator, agent.end, episodes)
    return episodes


def play(
    model: torch.nn.Module,
    episodes: list[Episode],
    agent: Agent,
    pad: int,
    budget: int,
    sampling: Sampling | None,
    synced: bool,
    group: int,
    room: int | None = None,
) -> int:
    """The episodes played to their ends (see the module's docstring), their ids written into them. `group`: each
    prompt comes that many times in a row, and its forward runs once. `room`: the padding columns the cache may
    hold before it is rebuilt without them (default: half the longest prompt and the budget). Returns how many
    times it was rebuilt."""
    device = next(model.parameters()).device
    held = [list(e.prompt) for e in episodes]  # each row's ids in the cache, with the step about to run
    room = (max(len(ids) for ids in held) + budget) // 2 if room is None else room
    rebuilt = 0
    input_ids, mask = left_padded([e.prompt for e in episodes], pad, device)
    cache = shared_prompts_cache(model, input_ids, mask, group) or DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    seen = cache.get_seq_length()
    step_ids, step_positions, attention = input_ids[:, seen:], positions[:, seen:], mask
    following = mask.sum(-1).cpu()  # each row's next position, by number
    live = torch.arange(len(episodes))
    pick = picker(sampling)
    while True:
        logits = model(
            input_ids=step_ids, attention_mask=attention, position_ids=step_positions, past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        ).logits[:, -1, :]  # fmt: skip
        places = torch.tensor([min(len(episodes[r].ids), budget - 1) for r in live.tolist()])
        tokens = pick(logits, live, places)[:, 0].tolist()
        feeds = _recorded(episodes, live.tolist(), tokens, agent, budget)
        ended, crowded = _agreed(len(feeds), _padding(attention, live.tolist(), feeds) > room, synced, device)
        if ended:
            return rebuilt
        if not feeds:  # decoded for the other processes' sake only (synced): one row, its output not recorded
            feeds = {int(live[0]): [tokens[0]]}
        kept = torch.tensor([n for n, row in enumerate(live.tolist()) if row in feeds])
        if len(kept) < len(live):
            cache.batch_select_indices(kept.to(device))
            live, attention = live[kept], attention[kept.to(device)]
        if crowded:  # every process rebuilds together (each forward gathers parameters under FSDP)
            cache, attention = _rebuilt(model, [held[row] for row in live.tolist()], pad, device)
            rebuilt += 1
        step_ids, step_mask, step_positions = _step(live.tolist(), feeds, following, pad, device)
        for row in live.tolist():
            held[row] += feeds[row]
        attention = torch.cat([attention, step_mask], dim=1)


def _recorded(
    episodes: list[Episode], rows: list[int], tokens: list[int], agent: Agent, budget: int
) -> dict[int, list[int]]:
    """Each live row's sampled token recorded (a row whose episode has ended records nothing); what each row still
    playing feeds next: its token, and the answer to its calls where its turn ended."""
    feeds, ended = {}, []
    for row, token in zip(rows, tokens, strict=True):
        episode = episodes[row]
        if episode.end:
            continue
        episode.ids.append(token)
        episode.wrote.append(1)
        if token in agent.stops:
            ended.append(row)
        elif len(episode.ids) >= budget:
            episode.end = "length"
            episode.messages.append(_cut_turn(episode, agent.tokenizer))
        else:
            feeds[row] = [token]
    for row, answer in zip(ended, agent.answers([episodes[row] for row in ended]), strict=True):
        episode = episodes[row]
        if answer is None:
            continue
        if len(episode.ids) + len(answer) >= budget:
            episode.end = "length"  # the answer does not fit: the episode ends with the turn that called
            continue
        episode.ids += answer
        episode.wrote += [0] * len(answer)
        episode.turn_start = len(episode.ids)
        feeds[row] = [episode.ids[-len(answer) - 1], *answer]
    return feeds


def _padding(attention: torch.Tensor, rows: list[int], feeds: dict[int, list[int]]) -> int:
    """The columns of padding the fullest row of the cache would hold after the next step (0 without feeds)."""
    if not feeds:
        return 0
    kept = [n for n, row in enumerate(rows) if row in feeds]
    held = attention[kept].sum(-1).tolist()
    longest = max(int(h) + len(feeds[rows[n]]) for h, n in zip(held, kept, strict=True))
    return attention.shape[1] + max(len(feed) for feed in feeds.values()) - longest


def _agreed(remaining: int, crowded: bool, synced: bool, device: torch.device) -> tuple[bool, bool]:
    """Whether decoding stops (no row writes on any process) and whether the cache is rebuilt (it is crowded on
    some process): one all-reduce a step in lock-step, as `all_ended`."""
    if not synced:
        return remaining == 0, crowded
    everywhere = torch.tensor([remaining, int(crowded)], device=device)
    torch.distributed.all_reduce(everywhere)
    return int(everywhere[0]) == 0, bool(everywhere[1])


def _rebuilt(
    model: torch.nn.Module, held: list[list[int]], pad: int, device: torch.device
) -> tuple[DynamicCache, torch.Tensor]:
    """A cache of the ids each row holds, left-padded only to the longest (one forward), and its mask."""
    input_ids, mask = left_padded(held, pad, device)
    return prefilled(model, input_ids, mask), mask


def _cut_turn(episode: Episode, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The message of a turn cut at the budget."""
    episode.counts["turns"] += 1
    text = tokenizer.decode(episode.ids[episode.turn_start :], skip_special_tokens=True)
    return {"role": "assistant", "content": text}


def _step(
    rows: list[int], feeds: dict[int, list[int]], following: torch.Tensor, pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next forward's ids, mask columns and positions: each row's feed, left-padded to the longest."""
    width = max(len(feeds[row]) for row in rows)
    ids, mask, positions = [], [], []
    for row in rows:
        feed = feeds[row]
        start = int(following[row])
        ids.append([pad] * (width - len(feed)) + feed)
        mask.append([0] * (width - len(feed)) + [1] * len(feed))
        positions.append([1] * (width - len(feed)) + list(range(start, start + len(feed))))
        following[row] = start + len(feed)
    as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
    return as_tensor(ids), as_tensor(mask), as_tensor(positions)
