"""Evaluation by generation (`eval.generate`): held-out prompts answered by the model as it trains, scored.

The prompts are the eval split's: a conversation up to its last assistant turn, rendered with the chat template's
generation prompt (the reference: that turn's text), or a prompt/completion sample's prompt (the reference: its
completion); `eval.generate.column` names another column as the reference. Greedy decoding with a KV cache, up to
`max_new_tokens`; the completion is decoded without special tokens and stripped, then scored: `exact_match` (equal
to the reference, stripped) or `contains` (the reference appears in it).

Under FSDP every forward gathers parameters from every process, so the processes decode in lock-step:
transformers' `synced_gpus` keeps a process whose completions have all ended running forwards (their outputs
discarded) until every process's have. Each process answers its share of the prompts (equal shares: the last
prompt repeats where they do not divide, and is scored once); the scores are summed over processes, so a run
reports the same numbers on any process count. Generation attends through SDPA with the padding mask (prompts are
left-padded), whatever the training attention: the varlen path knows whole packed rows, not a growing cache; under
sequence parallelism each process generates on whole rows of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from finetune import attention
from finetune.config import GenerateConfig
from finetune.distributed import equal_share
from finetune.wrap import reshard

BATCH = 16
"""Prompts decoded together on a process."""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    reference: str


@dataclass
class GenerationEval:
    """`eval.generate` for a run: its prompts, and how completions are scored."""

    cfg: GenerateConfig
    prompts: list[Prompt]
    tokenizer: PreTrainedTokenizerBase

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, accelerator: Accelerator) -> dict[str, float]:
        """The share of prompts whose completion scores, and the completions' mean length in tokens (a
        collective: every process calls it)."""
        mine, real = equal_share(len(self.prompts), accelerator.num_processes, accelerator.process_index)
        scored = torch.zeros(3, dtype=torch.float64)  # correct, completion tokens, prompts scored
        model.eval()
        with _generating(model):
            for start in range(0, len(mine), BATCH):
                batch = mine[start : start + BATCH]
                completions, lengths = self._complete(model, [self.prompts[i] for i in batch], accelerator)
                for n, (i, completion, length) in enumerate(zip(batch, completions, lengths, strict=True)):
                    if start + n < real:
                        scored += torch.tensor([self._score(completion, self.prompts[i].reference), length, 1.0])
        reshard(model)
        model.train()
        correct, tokens, count = accelerator.reduce(scored.to(accelerator.device), "sum").tolist()
        return {self.cfg.metric: correct / max(count, 1), "completion_tokens": tokens / max(count, 1)}

    def _complete(
        self, model: torch.nn.Module, prompts: list[Prompt], accelerator: Accelerator
    ) -> tuple[list[str], list[int]]:
        width = max(len(p.ids) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in prompts], device=accelerator.device)
        mask = torch.tensor(
            [[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts], device=accelerator.device
        )
        stops = _stop_tokens(model, self.tokenizer)
        output = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens, do_sample=False,
            eos_token_id=stops, pad_token_id=pad, synced_gpus=accelerator.num_processes > 1,
        )  # fmt: skip
        new = output[:, width:].tolist()
        ends = [next((n + 1 for n, token in enumerate(row) if token in stops), len(row)) for row in new]
        texts = [
            self.tokenizer.decode(row[:end], skip_special_tokens=True).strip()
            for row, end in zip(new, ends, strict=True)
        ]
        return texts, ends

    def _score(self, completion: str, reference: str) -> float:
        if self.cfg.metric == "contains":
            return float(reference.strip() in completion)
        return float(completion == reference.strip())

    def describe(self, step: int, values: dict[str, float]) -> str:
        """The log line of one evaluation."""
        share = values[self.cfg.metric]
        count = len(self.prompts)
        return (
            f"step {step}: {self.cfg.metric.replace('_', ' ')} {round(share * count)}/{count} ({100 * share:.1f}%) "
            f"by generation, {values['completion_tokens']:.1f} tokens a completion"
        )


def _stop_tokens(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Where a completion ends: the tokenizer's end of sequence and the model's generation config's (a chat model's
    end-of-turn token, where the two differ)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(t for t in [tokenizer.eos_token_id, *configured] if t is not None))


@contextlib.contextmanager
def _generating(model: torch.nn.Module) -> Iterator[None]:
    """The model as generation needs it: SDPA with the padding mask, rows whole on every process; then back."""
    inner = getattr(model, "module", model)
    implementation = inner.config._attn_implementation
    split = attention.current_sequence_group()
    attention.split_rows_over(None)
    if implementation == attention.NAME:
        inner.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if implementation == attention.NAME:
            inner.set_attn_implementation(implementation)
        attention.split_rows_over(split)
