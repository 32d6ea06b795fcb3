"""A learned reward: a reward model as an online RL reward (`rl.rewards: [{model: <folder>}]`), where no verifier
exists.

The folder is a scalar sequence classifier (what a `reward_model` run exports; checked from its config before any
weight loads). It is loaded after the policy, frozen, in the compute precision and sharded with the policy's per-layer
units (`finetune.objectives.reference.frozen_model`): no process holds it whole. Each episode, the prompt and its
completion (or an agent's whole exchange), is rendered as the reward model was trained to read it, with its own
tokenizer and chat template, which may differ from the policy's: a conversation by `apply_chat_template` whole, text
as the prompt's tokens, the completion's and EOS. The score is read raw at the rendering's last token
(`finetune.objectives.reward_model.sequence_scores`), in micro-batches of `micro_batch_size` renderings, padded.

Truncation: a rendering longer than `max_length` is scored on its last `max_length` tokens, its start cut and never
its end (where the score is read), and is counted: `rewards/<name>/truncated` is the share of a step's episodes cut.

Every process scores its own episodes, and the forwards are collectives: each process runs as many micro-batches as
the process with the most (repeating its last where it has fewer), and a rendering error on one process stops them
all with its message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from finetune.config import ModelConfig, RewardConfig
from finetune.data.preference import collate_sequences
from finetune.data.tokenize import IGNORE, encode_prompt_completions
from finetune.engine.processes import raised_together
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError, first_line
from finetune.model.loading import load_model_config
from finetune.model.score_head import is_reward_model, score_pad_id
from finetune.objectives.reference import frozen_model
from finetune.objectives.reward_model import sequence_scores


def check_reward_model(folder: str, name: str) -> int:
    """Refuse a folder that is not a scalar sequence classifier, before any weight loads; its trained length."""
    config = load_model_config(ModelConfig(name_or_path=folder), f"rl.rewards model {folder}")
    if not is_reward_model(config):
        architectures = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
        labels = getattr(config, "num_labels", None)
        raise FinetuneError(
            f"rl.rewards: {name}'s model {folder} is a {architectures} with {labels} labels, not a reward model (a "
            "sequence classifier with one label, as a reward_model run exports it); train one with a reward_model "
            "section, or give a function"
        )
    return config.get_text_config().max_position_embeddings


def learned_reward(cfg: RewardConfig) -> ModelReward:
    """The reward function of an `rl.rewards` entry that names a model (checked, not yet loaded)."""
    limit = check_reward_model(cfg.model, cfg.name)
    return ModelReward(cfg.name, cfg.model, cfg.max_length or limit, cfg.micro_batch_size)


@dataclass
class ModelReward:
    """A reward function (`finetune.rollouts.rewards.Reward.function`) backed by a sharded reward model; `load`ed
    once the run is built."""

    name: str
    folder: str
    max_length: int
    micro_batch_size: int | None = None
    model: torch.nn.Module | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    accelerator: Accelerator | None = None
    counts: list[int] = field(default_factory=lambda: [0, 0])
    """Episodes truncated and episodes scored since the last `take_counts`."""

    def load(self, policy: ModelConfig, accelerator: Accelerator, micro_batch_size: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        pad = score_pad_id(self.tokenizer, self.folder)
        policy = dataclasses.replace(policy, config_overrides={})  # the policy's overrides are not the reward model's
        self.model = frozen_model(policy, self.folder, accelerator, f"rl.rewards: {self.name}", "reward model",
                                  score_pad_id=pad)  # fmt: skip
        self.accelerator = accelerator
        self.micro_batch_size = self.micro_batch_size or micro_batch_size

    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        """Each episode's raw score (a collective: every process calls it with its own episodes)."""
        if self.model is None:
            raise RuntimeError(f"the reward model {self.folder} is called before it is loaded")
        renderings = raised_together(self.accelerator, self._render, prompts, completions)
        return self._scores(renderings)

    def _render(self, prompts: list[Any], completions: list[Any]) -> list[list[int]]:
        renderings = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):
                turns = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
                try:
                    ids = self.tokenizer.apply_chat_template([*prompt, *turns], tokenize=True)["input_ids"]
                except Exception as exc:  # the template's own error (jinja's, or none set): the user's to fix
                    raise FinetuneError(
                        f"rl.rewards: {self.name}: the reward model's chat template cannot render the episodes "
                        f"({type(exc).__name__}: {first_line(exc)}); give {self.folder} a chat template that renders "
                        "the policy's conversations (its tokenizer_config.json's chat_template)"
                    ) from None
            else:
                [(ids, _)] = encode_prompt_completions([prompt], [str(completion)], self.tokenizer, True)
            self.counts[0] += len(ids) > self.max_length
            renderings.append(ids[-self.max_length :])
        self.counts[1] += len(renderings)
        return renderings

    @torch.no_grad()
    def _scores(self, renderings: list[list[int]]) -> list[float]:
        size = self.micro_batch_size
        chunks = [renderings[n : n + size] for n in range(0, len(renderings), size)]
        device = self.accelerator.device
        most = torch.tensor(len(chunks), device=device)
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        scores: list[float] = []
        for n in range(int(most.item())):
            chunk = chunks[min(n, len(chunks) - 1)] if chunks else [[self.tokenizer.eos_token_id or 0]]
            sequences = [(ids, [IGNORE] * len(ids)) for ids in chunk]
            batch = collate_sequences(sequences, max_length=self.max_length, pad_id=self.model.config.pad_token_id,
                                      packing=False)  # fmt: skip
            batch = {key: value.to(device) for key, value in batch.items()}
            values = sequence_scores(self.model, batch).float().cpu().tolist()
            if n < len(chunks):  # a repeat only keeps this process in step with the others
                scores += values
        reshard(self.model)
        return scores

    def take_counts(self) -> tuple[int, int]:
        """(truncated, scored) since the last call."""
        counts, self.counts = tuple(self.counts), [0, 0]
        return counts  # type: ignore[return-value]
