"""Prompts for online RL (`finetune.objectives.grpo`): TRL's prompt-only layout, tokenized, every column kept.

A sample is a `prompt` (text, or a list of messages rendered with the chat template's generation prompt, or,
when it ends with an assistant message, continuing that message as TRL does) and any other columns (an `answer`,
test cases), which reach the reward functions as they are. The model writes the rest, so a prompt must leave
`rl.max_new_tokens` of `data.max_length`: a longer one is refused, or left out and counted with
data.truncation=drop (cutting it would ask a different question). Each prompt is checked as it is read: an empty
or malformed one is refused naming its sample, or left out and counted with data.invalid=drop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy
import torch
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig
from finetune.data.chat.messages import chat_tools
from finetune.data.prompts import prompt_tokens
from finetune.data.sources import SAMPLE_INDEX, source_name
from finetune.data.tokenize import check_invalid_share
from finetune.engine.quiet import no_datasets_bars
from finetune.errors import FinetuneError

PROMPT_COLUMNS = ("prompt_ids", "prompt_index")
"""What tokenization adds: the prompt's token ids, and its number in the split (part of its completions' seed)."""


@dataclass(frozen=True)
class PromptStats:
    num_prompts: int
    num_too_long: int
    num_tokens: int
    longest: int
    num_invalid: int = 0
    """data.invalid=drop: malformed prompts left out, and the first reasons."""
    invalid_examples: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """What the rewards say of the prompts kept (rows they leave unscored)."""

    def describe(self, split: str) -> str:
        dropped = f", {self.num_too_long:,} dropped as longer than the room left for completions" * bool(
            self.num_too_long
        )
        if self.num_invalid:
            dropped += f", {self.num_invalid:,} invalid dropped (first: {' | '.join(self.invalid_examples)})"
        dropped += "".join(f"; {note}" for note in self.notes)
        return f"{split}: {self.num_prompts:,} prompts, {self.num_tokens:,} tokens (longest {self.longest:,}){dropped}"


class PromptOnly:
    """Prompt-only samples (`finetune.data.Samples`): batched as prompts; the objective samples the rest."""

    numbered = False

    def __init__(
        self,
        max_new_tokens: int,
        check_columns: Callable[[list[str], str], None],
        unscored: Callable[[datasets.Dataset], list[str]] = lambda prompts: [],
        tools: list[dict[str, Any]] | None = None,
    ):
        self.max_new_tokens = max_new_tokens
        self.tools = tools or []
        """Schemas offered with every prompt (online RL's tools), after the row's own `tools`."""
        self.check_columns = check_columns
        """Refuses data lacking a column the rewards read (given its columns, and where it is, for the message)."""
        self.unscored = unscored
        """What the rewards leave unscored in the prompts kept: said once, with the data's counts."""

    def prepare(
        self,
        parts: list[tuple[Any, datasets.Dataset]],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        seed: int,
        evaluation: bool = False,
        first_index: int = 0,
    ) -> tuple[datasets.Dataset, PromptStats]:
        room = cfg.max_length - self.max_new_tokens
        tokenized, too_long, invalid = [], 0, []
        for source, dataset in parts:
            where = source_name(source, cfg, evaluation) or ("the eval data" if evaluation else "the training data")
            columns = [c for c in dataset.column_names if c != SAMPLE_INDEX]
            if "prompt" not in columns:
                raise FinetuneError(
                    f"an rl section samples completions to prompts, and {where} has no prompt column "
                    f"({', '.join(columns)}); rename its prompt column with a columns mapping"
                )
            self.check_columns(columns, where)
            if not tokenizer.chat_template and any(isinstance(p, list) for p in dataset["prompt"]):
                raise FinetuneError(
                    f"{where} holds conversations as prompts, and the tokenizer has no chat template to render them; "
                    "set data.chat_template (a .jinja file), or give the prompts as text"
                )
            try:
                with no_datasets_bars():
                    part = dataset.map(
                        lambda sample, index: _tokenized(sample, index, tokenizer, cfg.invalid == "drop", self.tools),
                        with_indices=True, desc="tokenizing (prompts)",
                    )  # fmt: skip
            except FinetuneError as exc:
                raise FinetuneError(f"{where}: {exc}") from None
            if cfg.invalid == "drop":
                check_invalid_share(part, where)
                reasons = [reason for reason in part["invalid"] if reason]
                invalid += [f"{where}: {reason}" for reason in reasons]
                part = part.remove_columns("invalid")
            lengths = numpy.array([len(ids) for ids in part["prompt_ids"]])
            long = numpy.flatnonzero(lengths > room)
            if len(long) and cfg.truncation != "drop":
                first = int(part[int(long[0])][SAMPLE_INDEX]) if SAMPLE_INDEX in part.column_names else int(long[0])
                raise FinetuneError(
                    f"{len(long):,} prompts of {where} (the first: sample {first}, {lengths[long[0]]:,} tokens) are "
                    f"longer than data.max_length - rl.max_new_tokens = {room:,} tokens, the room a prompt has; raise "
                    "data.max_length, lower rl.max_new_tokens, or set data.truncation=drop to leave them out (counted)"
                )
            too_long += len(long)
            keep = (lengths <= room) & (lengths > 0)  # 0 tokens: invalid (data.invalid=drop), left out
            kept = part if keep.all() else part.select(numpy.flatnonzero(keep))
            tokenized.append(kept.remove_columns([c for c in kept.column_names if c == SAMPLE_INDEX]))
        try:
            every = tokenized[0] if len(tokenized) == 1 else datasets.concatenate_datasets(tokenized)
        except ValueError as exc:
            raise FinetuneError(
                f"the sources of an rl run's data have different columns ({exc}); give every source the same columns "
                "with its columns mapping"
            ) from None
        if len(every) == 0:
            raise FinetuneError(
                f"no prompt fits data.max_length - rl.max_new_tokens = {room:,} tokens; raise data.max_length or "
                "lower rl.max_new_tokens"
            )
        every = every.add_column("prompt_index", numpy.arange(len(every), dtype=numpy.int64))
        lengths = numpy.array([len(ids) for ids in every["prompt_ids"]])
        stats = PromptStats(
            len(every), too_long, int(lengths.sum()), int(lengths.max()), len(invalid), tuple(invalid[:3]),
            tuple(self.unscored(every)),
        )  # fmt: skip
        return every, stats

    def collate(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
        pad = tokenizer.pad_token_id

        def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
            """Prompts left-padded (as generation takes them), with their ids, numbers and columns as they are."""
            width = max(len(row["prompt_ids"]) for row in rows)
            columns = [c for c in rows[0] if c not in PROMPT_COLUMNS]
            return {
                "input_ids": torch.tensor([[pad] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in rows]),
                "prompt_index": torch.tensor([row["prompt_index"] for row in rows]),
                "prompt_ids": [row["prompt_ids"] for row in rows],
                "columns": {name: [row[name] for row in rows] for name in columns},
            }

        return collate


def _tokenized(
    sample: dict[str, Any], index: int, tokenizer: PreTrainedTokenizerBase, drop_invalid: bool,
    tools: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """A sample's prompt tokens, or (data.invalid=drop) none and the reason it was refused."""
    index = sample.get(SAMPLE_INDEX, index)
    try:
        ids = prompt_tokens(sample["prompt"], offered_tools(sample.get("tools"), tools, index), tokenizer, index)
    except FinetuneError as exc:
        if not drop_invalid:
            raise
        return {"prompt_ids": [], "invalid": str(exc)}
    return {"prompt_ids": ids, **({"invalid": ""} if drop_invalid else {})}


def offered_tools(row_tools: Any, run_tools: list[dict[str, Any]], index: int) -> list[dict[str, Any]] | None:
    """The tools a prompt is rendered with: its row's own (its `tools` column), then the run's (online RL's)."""
    own = chat_tools(row_tools, index) or []
    return [*own, *run_tools] or None
