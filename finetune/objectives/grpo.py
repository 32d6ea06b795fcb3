"""Online RL with verifiable rewards: GRPO, and DAPO's and Dr. GRPO's losses (the `rl` section).

A step's prompts (the loop's micro-batches of prompt-only samples, `finetune.data.prompt_only`) are answered
`num_generations` times each by the model as it stands (`rollout`): sampled with seeded noise
(`finetune.rollouts.generation`), scored by the rewards (`finetune.rollouts.rewards`), and each completion's advantage
is its reward minus its group's mean, divided by the group's (or the step's) standard deviation. Every completion of a
prompt is sampled on the process that holds the prompt, so a group's statistics need no communication, and the
noise depends on the prompt's number and the rollout, never on the process: the same completions on any
process count. Each micro-batch of prompts becomes a micro-batch of their completions (prompt + completion rows,
right-padded, the completion tokens trained).

Its pieces, each a module here: the advantages (`advantages`), the loss of a completion token and its sum
(`policy_loss`), the groups a dynamically sampled step trains and their dealing over processes
(`rollout_groups`), and what the log says of rollouts (`rollout_metrics`); generation and rewards are
`finetune.rollouts`'. With `num_iterations` > 1 a rollout is trained on for that many steps, against the
log-probabilities it was sampled with (computed once, before its first update); checkpoints fall between
rollouts (the config says so), where a run resumes exactly: a rollout depends only on the weights and the seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.config import ModelConfig, RLConfig
from finetune.data.pack import with_host_indices
from finetune.data.prompt_only import PromptOnly
from finetune.data.prompts import content_text
from finetune.data.rollout import separate_rows, shared_rows
from finetune.engine import attention, shared_attention
from finetune.engine.batch import Batch
from finetune.engine.processes import raised_together
from finetune.engine.sequence import gather_rows
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError
from finetune.model.dropout import disable_dropout
from finetune.model.loading import load_model_config
from finetune.model.weights import BaseSwitch
from finetune.objectives.advantages import advantages
from finetune.objectives.learned_reward import ModelReward, learned_reward
from finetune.objectives.loss import LossPath, token_logps
from finetune.objectives.policy_loss import summed_loss, token_losses
from finetune.objectives.rollout_groups import Sampled, dealt, summed_over_processes
from finetune.objectives.rollout_metrics import RolloutWindow
from finetune.rollouts.episodes import Agent, Episode, sample_episodes
from finetune.rollouts.generation import (
    Sampling,
    complete,
    cut_short,
    decodes_itself,
    gathers_once,
    generating,
    rollout_decoding,
    row_noise,
    sample_rollout,
    stop_tokens,
)
from finetune.rollouts.rewards import (
    ENVIRONMENT_REWARDS,
    EPISODE_ENDS,
    Reward,
    build_rewards,
    check_columns,
    environment_reward,
    score,
    unfinished_only,
    unfinished_reward,
    unscored,
)
from finetune.rollouts.static_decode import StaticDecoding, check_static_cache
from finetune.rollouts.tool_calls import tool_template
from finetune.rollouts.tools import EnvironmentFactory, load_tools

if TYPE_CHECKING:
    from finetune.objectives import BuildContext


@dataclass
class GRPO:
    """The `rl` objective (`finetune.objectives.Objective`), with `rollout` answering each step's prompts."""

    cfg: RLConfig
    loss_path: LossPath
    rewards: list[Reward]
    tokenizer: PreTrainedTokenizerBase
    seed: int
    base_switch: BaseSwitch | None = None
    """The KL penalty's reference as the model itself with its adapters switched off (the weights seam's
    `base_switch`); else, with beta > 0, `reference_model`."""
    reference_model: torch.nn.Module | None = None
    """A frozen copy of the initial weights, the KL penalty's reference where no switch gives it."""
    gather_once: bool = True
    """Generation keeps every layer's parameters gathered from the first decoding step to the last."""
    static: StaticDecoding | None = None
    """The rollouts' decoding over a static cache (rl.rollout_cache: static), kept for the run: its compiled steps."""
    share_prompts: bool = False
    """The models attend with `shared_prompt` attention: a prompt's completions share its row (`finetune.data.rollout`:
    never more positions than a row each); else a row each."""
    window: RolloutWindow = field(init=False)
    cached: tuple[int, list[Batch]] | None = None
    """The rollout trained on again (num_iterations > 1): the step it was sampled at, and its micro-batches."""
    agent: Agent | None = None
    """Agents (rl.tools, rl.environment_factory): completions are episodes (`finetune.rollouts.episodes`)."""
    metric_names: tuple[str, ...] = ()
    progress_name: str | None = None

    def __post_init__(self) -> None:
        self.window = RolloutWindow(tuple(reward.name for reward in self.rewards))

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

    @property
    def learned_rewards(self) -> list[ModelReward]:
        return [reward.function for reward in self.rewards if isinstance(reward.function, ModelReward)]

    def periodic_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        metrics = self.window.metrics(accelerator, self.cfg.beta)
        for learned in self.learned_rewards:  # the share of episodes a reward model scored on their end only
            counts = accelerator.reduce(torch.tensor(learned.take_counts(), device=accelerator.device), "sum")
            truncated, scored = counts.tolist()
            if scored:
                metrics[f"rewards/{learned.name}/truncated"] = truncated / scored
        return metrics

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
                sampled.wrote[start : start + rows],
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
    ) -> Sampled:
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
        if self.agent is not None:
            self.agent.waited = 0.0  # this rollout's wait for tools alone (an evaluation's episodes wait too)
            episodes = self._episodes(model, micro_batches, prompts, accelerator, sampling, generations)
            completions, wrote = [e.ids for e in episodes], [e.wrote for e in episodes]
            truncated = [e.end == "length" for e in episodes]
            self.window.add_episodes([e.counts for e in episodes], [e.end for e in episodes], [sum(w) for w in wrote])
            self.window.tool_seconds += self.agent.waited
        else:
            completions = sample_rollout(
                model, prompts, self.tokenizer, accelerator, new_tokens, sampling, once, generations, self.static
            )
            wrote, episodes = [[1] * len(c) for c in completions], None
            truncated = cut_short(completions, stop_tokens(model, self.tokenizer))  # cut at max_new_tokens
        seconds = time.perf_counter() - began
        per_function = raised_together(accelerator, self._score, micro_batches, completions, generations, episodes)
        _, rewards, no_signal = advantages(per_function, self._weights, generations, "group")
        lengths = [len(c) for c in completions]
        self.window.add_rollout(rewards, per_function, lengths, truncated, no_signal, generations, seconds)
        signal = ~no_signal.view(-1, generations)[:, 0]
        return Sampled(prompts, completions, per_function, truncated, [(round_, i) for i in indices], signal, wrote)

    def _episodes(
        self,
        model: torch.nn.Module,
        micro_batches: list[Batch],
        prompts: list[list[int]],
        accelerator: Accelerator,
        sampling: Sampling | None,
        generations: int,
    ) -> list[Episode]:
        """The prompts' episodes (agents), each with its environment's reward (`environment_reward`)."""
        rows = [
            {**{name: values[n] for name, values in batch["columns"].items()}, "prompt_index": int(index)}
            for batch in micro_batches for n, index in enumerate(batch["prompt_index"]) for _ in range(generations)
        ]  # fmt: skip
        return sample_episodes(
            model, self.agent, prompts, rows, accelerator, self.cfg.max_new_tokens, sampling, self.gather_once,
            generations,
        )  # fmt: skip

    def _refilled(
        self,
        model: torch.nn.Module,
        sampled: Sampled,
        draw: Callable[[], list[Batch]],
        first_step: int,
        micro: int,
        accelerator: Accelerator,
    ) -> Sampled:
        """Dynamic sampling (DAPO's): while fewer groups of the step have a reward spread than it trains, and at
        most rl.dynamic_sampling_rounds times, another window of prompts is drawn and answered; then the step trains
        the groups with signal first, in the order (round, prompt number), the rest filled by groups without: the
        same groups on any process count, dealt to the processes as the loader deals prompts."""
        groups = len(sampled.keys)
        total = int(summed_over_processes(accelerator, [groups])[0])
        rounds = [sampled]
        while True:
            with_signal = int(summed_over_processes(accelerator, [sum(int(r.signal.sum()) for r in rounds)])[0])
            if with_signal >= total or len(rounds) > self.cfg.dynamic_sampling_rounds:
                break
            rounds.append(self._sample(model, draw(), first_step, len(rounds), accelerator))
        merged = Sampled.joined(rounds)
        kept = dealt(accelerator, merged, total, micro, self.cfg.num_generations)
        self.window.add_refill(groups, len(merged.keys) - groups, with_signal < total)
        return kept

    @property
    def _weights(self) -> torch.Tensor:
        return torch.tensor([reward.weight for reward in self.rewards])

    def _score(
        self,
        micro_batches: list[Batch],
        completions: list[list[int]],
        repeats: int,
        episodes: list[Episode] | None = None,
    ) -> torch.Tensor:
        """Rewards per completion and function, each function called once with every completion given; each
        prompt's columns repeated for its `repeats` completions. Episodes are given as their messages (the model's
        ids as completion_ids), with their environments' rewards."""
        columns: dict[str, list[Any]] = {}
        for batch in micro_batches:
            for name, values in batch["columns"].items():
                columns.setdefault(name, []).extend(v for v in values for _ in range(repeats))
        prompts = columns.pop("prompt")
        if episodes is not None:
            ends = [e.end for e in episodes]
            columns[ENVIRONMENT_REWARDS], columns[EPISODE_ENDS] = [e.environment_reward for e in episodes], ends
            scores = score(self.rewards, prompts, [e.messages for e in episodes], [e.model_ids for e in episodes],
                           columns)  # fmt: skip
            if self.cfg.unfinished_reward is None:
                return scores
            return unfinished_only(scores, ends, [reward.name for reward in self.rewards])
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
        self,
        prompts: list[list[int]],
        completions: list[list[int]],
        advantage: torch.Tensor,
        truncated: list[bool],
        wrote: list[list[int]],
    ) -> Batch:
        """The completions as training rows (`finetune.data.rollout`): each prompt shared by its completions where
        the model's attention can, else a row per completion; the completions' tokens are the targets, in the same
        order either way, those the model did not write (an episode's tool answers) masked."""
        pad, group = self.tokenizer.pad_token_id, self.cfg.num_generations
        if self.share_prompts:
            rows = shared_rows(prompts, completions, group, pad)
        else:
            rows = separate_rows(prompts, completions, pad)
        token_sequence = [n for n, completion in enumerate(completions) for _ in completion]
        masked = [self.cfg.mask_truncated and cut for cut in truncated]
        token_mask = [0.0 if masked[n] else float(w) for n, completion in enumerate(wrote) for w in completion]
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
            if self.reference_model is not None:
                batch["ref_logps"] = token_logps(self.reference_model, batch, self.loss_path, self.cfg.temperature)
            elif self.base_switch is not None:
                with self.base_switch(model):
                    batch["ref_logps"] = token_logps(model, batch, self.loss_path, self.cfg.temperature)
        if self.cfg.num_iterations > 1 or self.cfg.beta:
            reshard(model)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
        """The held-out prompts answered greedily, once each: the mean reward (and each function's, over the
        completions it scored) and completion length, each prompt counted once whatever the process count."""
        model.eval()
        sums = torch.zeros(2 + 2 * len(self.rewards), dtype=torch.float64)
        count = 0
        # Episodes enter generation themselves (with their environments around it).
        with generating(model, gather_once=self.gather_once) if self.agent is None else nullcontext() as lock_step:
            for batch in loader:
                episodes = None
                if self.agent is not None:  # greedy episodes
                    episodes = self._episodes(model, [batch], batch["prompt_ids"], accelerator, None, 1)
                    completions = [e.ids for e in episodes]
                else:
                    completions = complete(
                        model, batch["prompt_ids"], self.tokenizer, accelerator, self.cfg.max_new_tokens,
                        lock_step=lock_step,
                    )  # fmt: skip
                per_function = raised_together(accelerator, self._score, [batch], completions, 1, episodes)
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
    imported and checked at once, and the reference the KL penalty compares with (beta > 0): the model with its
    adapters switched off where the weights seam has such a switch, else a frozen copy of the initial weights."""

    name = "rl"
    unit_noun = "prompts"
    reference_setting = "model.name_or_path (the KL penalty's reference)"
    reference_model = None  # the reference is the policy's own initial weights: nothing more to check before loading

    def __init__(self, cfg: RLConfig, model: ModelConfig):
        self.cfg = cfg
        # Before anything loads: an import error is found in seconds, a cache the model's layers cannot use too.
        if cfg.rollout_cache == "static":
            check_static_cache(load_model_config(model), model.name_or_path)
        self.rewards = build_rewards(cfg.rewards, cfg.max_new_tokens, learned_reward)
        self.tools = load_tools(cfg.tools)
        factory = cfg.environment_factory
        self.environment = EnvironmentFactory.load(factory, self.tools) if factory else None
        if self.environment is not None and self.environment.rewarded:
            self.rewards.append(environment_reward(self.environment.kind.__name__))
        if cfg.unfinished_reward is not None:
            self.rewards.append(unfinished_reward(cfg.unfinished_reward))
        if not self.rewards:
            raise FinetuneError(
                f"rl.rewards is empty and rl.environment_factory={cfg.environment_factory} gives no reward (its "
                "environments have no get_reward method); name a reward in rl.rewards, or define get_reward"
            )
        schemas = [tool.schema for tool in self.tools] + (self.environment.schemas if self.environment else [])
        self.samples = PromptOnly(
            cfg.max_new_tokens,
            lambda columns, where: check_columns(self.rewards, columns, where),
            lambda prompts: unscored(self.rewards, prompts),
            schemas,
        )

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
            self.cfg, context.loss_path, self.rewards, context.tokenizer, context.recipe.train.seed,
            base_switch=context.weights.base_switch() if self.cfg.beta else None, gather_once=once, static=static,
            agent=self._agent(model, context.tokenizer, static, accelerator),
        )  # fmt: skip
        if self.cfg.beta and objective.base_switch is None:
            from finetune.objectives.reference import frozen_model

            base = context.recipe.model
            objective.reference_model = frozen_model(base, base.name_or_path, accelerator,
                                                     "rl.beta > 0: the initial weights")  # fmt: skip
        rows = context.recipe.train.micro_batch_size * self.cfg.num_generations
        for learned in objective.learned_rewards:
            learned.load(context.recipe.model, accelerator, rows)
        models = [model] + ([accelerator.unwrap_model(objective.reference_model)] if objective.reference_model else [])
        objective.share_prompts, line = _share_prompts(models)
        accelerator.print(line)
        return objective, lambda: None

    def _agent(
        self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, static: StaticDecoding | None,
        accelerator: Accelerator,
    ) -> Agent | None:  # fmt: skip
        """What plays episodes (agents: rl.tools or rl.environment_factory), with the log's line on the template's
        calls; None for single-turn completions."""
        if not self.cfg.agents:
            return None
        if static is not None or not decodes_itself(model):
            why = "rl.rollout_cache=static" if static is not None else f"{type(model).__name__}'s own kind of cache"
            raise FinetuneError(
                f"rl.tools: episodes are decoded over a dynamic KV cache that answers are appended to, not {why}; "
                "set rl.rollout_cache: dynamic (a model whose cache is of its own kind cannot play episodes)"
            )
        template = tool_template(tokenizer)
        accelerator.print(f"agents: {template.describe()}")
        difference = template.history_difference()
        if difference is not None:
            accelerator.print(
                f"agents: the chat template renders a finished turn otherwise than the model read it while acting "
                f"({difference}); episodes keep what the model read and wrote, which SFT on the same conversations "
                "would not train on"
            )
        stops = stop_tokens(model, tokenizer)
        ends = [tokenizer.convert_tokens_to_ids(end) for end in template.ends if end in tokenizer.get_vocab()]
        return Agent(tokenizer, template, self.tools, self.environment, self.cfg.max_turns, self.cfg.tool_timeout,
                     list(dict.fromkeys(stops + ends)), self.cfg.episode_timeout)  # fmt: skip


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
