"""Preference pairs -> token ids of the chosen and the rejected sequence, with their reply tokens marked.

A sample is TRL's layout: `prompt` + `chosen` + `rejected`, each a list of messages (conversational) or
a string; or `chosen` and `rejected` as whole conversations that share their prompt (then a `prompt`
column, as ultrafeedback_binarized carries, is the same text again and is not rendered twice). Each
side is rendered as one whole conversation by the chat path that locates replies (`finetune.data.chat`),
so the trained tokens of each are exactly its last assistant reply as the template renders it, through
its end-of-turn marker; what comes before is the prompt, and it must be the same tokens on both sides
(a pair whose prompts render differently is refused with its index). Strings get the tokenizer's BOS
and one EOS, as prompt/completion data does.

Too long for `data.max_length`: the prompt is cut from the left (its last turns kept) until both
sequences fit; a pair whose replies alone do not fit is dropped, never a reply cut in the middle.
A pair whose chosen and rejected replies are the same teaches nothing and is dropped; both are counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig
from finetune.data.chat import describe, encode_rendered, message_role, render_chats
from finetune.data.pack import balanced_rows, with_host_indices
from finetune.data.sources import SAMPLE_INDEX, source_name
from finetune.data.tokenize import (
    IGNORE,
    check_invalid_share,
    encode_prompt_completions,
    map_processes,
    with_text_reasoning,
)
from finetune.engine.quiet import no_datasets_bars
from finetune.errors import FinetuneError

PAIR_COLUMNS = ("chosen", "rejected")
PAIRS = datasets.Features({
    "chosen_ids": datasets.List(datasets.Value("int32")), "chosen_targets": datasets.List(datasets.Value("int32")),
    "rejected_ids": datasets.List(datasets.Value("int32")),
    "rejected_targets": datasets.List(datasets.Value("int32")),
    "truncated": datasets.Value("bool"), "kept": datasets.Value("bool"), "same": datasets.Value("bool"),
    "reasoning": datasets.Value("int32"), "invalid": datasets.Value("string"), "margin": datasets.Value("float32"),
})  # fmt: skip
"""A tokenized pair: each side's ids and targets (the next token where loss is taken, else IGNORE); `truncated`
(its prompt was cut), `kept` (both sides fit, and the pair is valid), `same` (chosen equals rejected: dropped),
`reasoning` (tokens of reasoning in both replies), `invalid` (data.invalid=drop: why it was refused, else ""),
`margin` (the `margin` column: how far a reward model's chosen score must lead the rejected one; 0 without it)."""


def tokenize_pairs(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, whole: bool = False
) -> datasets.Dataset:
    """Tokenize every pair (cached by `datasets` under the fingerprint of data and settings); `whole`: each side of a
    conversation through the end of its rendering, what the template writes after the last reply included."""
    missing = [column for column in PAIR_COLUMNS if column not in dataset.column_names]
    if missing:
        columns = [c for c in dataset.column_names if c != SAMPLE_INDEX]
        raise FinetuneError(
            f"preference data needs chosen and rejected columns (and prompt, unless chosen and rejected are whole "
            f"conversations); the dataset has {columns}: rename them with a columns mapping"
        )
    encode = functools.partial(_encode_pairs, tokenizer=tokenizer, cfg=cfg, whole=whole)
    return dataset.map(
        encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc="tokenizing (preference)",
        num_proc=map_processes(len(dataset)), features=PAIRS,
    )  # fmt: skip


def _encode_pairs(
    batch: dict[str, list], indices: list[int], *, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, whole: bool
) -> dict[str, list]:
    indices = batch.pop(SAMPLE_INDEX, indices)
    try:
        return _encode_batch(batch, indices, tokenizer, cfg, whole)
    except FinetuneError:
        if cfg.invalid != "drop":
            raise
    # data.invalid=drop, for a batch some pair of which was refused: each pair alone, a refused one kept as a
    # pair not kept, carrying its reason (counted, and stopping the run past tokenize.MAX_INVALID_SHARE).
    out: dict[str, list] = {key: [] for key in PAIRS}
    for n, index in enumerate(indices):
        try:
            alone = {column: values[n : n + 1] for column, values in batch.items()}
            one = _encode_batch(alone, [index], tokenizer, cfg, whole)
        except FinetuneError as exc:
            one = {key: [[]] if key.endswith(("_ids", "_targets")) else [0] for key in PAIRS}
            one.update(truncated=[False], kept=[False], same=[False], invalid=[str(exc)], margin=[0.0])
        for key, values in one.items():
            out[key] += values
    return out


def _encode_batch(
    batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, whole: bool
) -> dict[str, list]:
    prompts = batch.get("prompt", [None] * len(indices))
    if all(isinstance(reply, str) for side in PAIR_COLUMNS for reply in batch[side]):
        sides = {side: encode_texts(prompts, batch[side], side, indices, tokenizer, cfg) for side in PAIR_COLUMNS}
    else:
        triples = zip(prompts, batch["chosen"], batch["rejected"], indices, strict=True)
        pairs = [prompted_conversations(p, {"chosen": c, "rejected": r}, index) for p, c, r, index in triples]
        tools = batch.get("tools")  # per sample, given to the template for both sides
        sides = {side: encode_conversations([pair[n] for pair in pairs], side, indices, tokenizer, tools, cfg, whole)
                 for n, side in enumerate(PAIR_COLUMNS)}  # fmt: skip
    out: dict[str, list] = {key: [] for key in PAIRS}
    out["margin"] = _margins(batch.get("margin"), indices)
    for n, index in enumerate(indices):
        chosen, rejected = sides["chosen"][n], sides["rejected"][n]
        if chosen.prompt != rejected.prompt:
            raise FinetuneError(
                f"sample {index}: chosen and rejected have different prompts (their texts before the replies differ "
                "once rendered); a pair must answer the same prompt: fix or remove it"
            )
        prompt = chosen.prompt
        room = cfg.max_length - max(len(chosen.reply), len(rejected.reply))
        truncated = len(prompt) > room
        # At least one prompt token (the first reply token must be somebody's target), and the whole prompt
        # unless data.truncation=truncate lets it be cut from the left (its last turns kept).
        kept = room >= 1 and (cfg.truncation == "truncate" or not truncated)
        if kept and truncated:
            prompt = prompt[len(prompt) - room :]
        for side, encoded in (("chosen", chosen), ("rejected", rejected)):
            ids = prompt + encoded.reply if kept else []
            out[f"{side}_ids"].append(ids)
            out[f"{side}_targets"].append([IGNORE] * (len(prompt) - 1) + encoded.targets() + [IGNORE] if kept else [])
        out["truncated"].append(truncated and kept)
        out["kept"].append(kept)
        out["same"].append(chosen.reply == rejected.reply and chosen.trained == rejected.trained)
        out["reasoning"].append(chosen.reasoning + rejected.reasoning)
        out["invalid"].append("")
    return out


def _margins(margins: list[Any] | None, indices: list[int]) -> list[float]:
    """The `margin` column's values (TRL's reward data: the chosen reply's required lead), 0 where there is none."""
    if margins is None:
        return [0.0] * len(indices)
    for margin, index in zip(margins, indices, strict=True):
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
            raise FinetuneError(f"sample {index}: margin must be a number, got {describe(margin)}; fix or remove it")
    return [float(margin) for margin in margins]


@dataclass(frozen=True)
class _Side:
    """One side of a pair: its prompt's ids, its completion's ids (from the first reply token through the last
    reply's end-of-turn marker), which of those are compared, and how many are reasoning."""

    prompt: list[int]
    reply: list[int]
    trained: list[bool]
    reasoning: int = 0

    def targets(self) -> list[int]:
        return [token if trained else IGNORE for token, trained in zip(self.reply, self.trained, strict=True)]


def encode_texts(
    prompts: list[Any],
    replies: list[str],
    side: str,
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
) -> list[_Side]:
    """Text pairs: the prompt's tokens, then the reply's and EOS, compared; a reply's leading <think> block is
    reasoning, kept as context under data.train_on_reasoning=false as in conversations."""
    for prompt, index in zip(prompts, indices, strict=True):
        if not isinstance(prompt, str):
            raise FinetuneError(
                f"sample {index}: {side} is text, so prompt must be text too, got {describe(prompt)}; fix or "
                "remove the sample"
            )
    sides = []
    encoded = encode_prompt_completions(prompts, replies, tokenizer, completion_only=True)
    starts = [trained.index(True) for _, trained in encoded]  # the reply's first token, before reasoning is masked
    encoded, reasoning = with_text_reasoning(encoded, replies, tokenizer, indices, cfg.train_on_reasoning)
    for (ids, trained), start, thought in zip(encoded, starts, reasoning, strict=True):
        sides.append(_Side(ids[:start], ids[start:], trained[start:], thought))
    return sides


_ASSISTANT, _USER = "assistant", "user"


def prompted_conversations(prompt: Any, sides: dict[str, Any], index: int) -> list[list[Any]]:
    """The conversations of one prompt's completions (`sides`: a pair's chosen and rejected, or one completion),
    as lists of messages: the shared prompt, then each side's completion, whose assistant replies are the only
    ones compared (a reply inside the prompt is context: weight 0).

    The prompt is, as TRL defines it: the `prompt` messages (also when the sides repeat them); text `prompt` beside
    replies alone, the user's turn; else (no prompt, or text beside whole conversations that begin with it, as
    ultrafeedback_binarized) the messages the sides share before they differ (one side alone: all but its last
    reply). A completion may hold several turns: every assistant reply in it is compared, the user and tool turns
    between are context."""
    names = " and ".join(sides)
    for side, turns in sides.items():
        if not isinstance(turns, (list, str)) or not turns:
            raise FinetuneError(
                f"sample {index}: {side} must be a list of messages or text, got {describe(turns)}; fix or remove it"
            )
    for side, turns in sides.items():
        if isinstance(turns, str):
            raise FinetuneError(
                f"sample {index}: {side} is text and the other side a list of messages; give both as text or both as "
                "messages"
            )
        if message_role(turns[-1]) != _ASSISTANT:
            raise FinetuneError(
                f"sample {index}: {side} must end with the assistant reply that is judged, got "
                f"{describe(turns[-1])}; fix or remove the sample"
            )
    completions = list(sides.values())
    if isinstance(prompt, str):
        firsts = {_first_user_text(turns) for turns in completions}
        if firsts == {None}:  # the replies alone
            prompt = [{"role": "user", "content": prompt}]
        elif firsts == {prompt.strip()}:  # whole conversations, the prompt column their first turn again
            prompt = None
        else:
            kind = "are conversations" if len(sides) > 1 else "is a conversation"
            raise FinetuneError(
                f"sample {index}: prompt is text, but {names} {kind} whose first user turn is other text; give "
                "them as the assistant's replies alone (the prompt is then the user's turn), or as whole "
                "conversations that begin with the prompt"
            )
    elif prompt is not None and not isinstance(prompt, list):
        raise FinetuneError(
            f"sample {index}: prompt must be a list of messages or text, got {describe(prompt)}; fix or remove it"
        )
    if prompt is None:
        shared = 0
        while shared < min(map(len, completions)) - 1 and _same(completions, shared):
            shared += 1
        prompt, completions = completions[0][:shared], [c[shared:] for c in completions]
    elif prompt and all(c[: len(prompt)] == prompt for c in completions):
        completions = [c[len(prompt) :] for c in completions]  # whole conversations with the prompt
    for side, completion in zip(sides, completions, strict=True):
        if (role := message_role(completion[0])) != _ASSISTANT:
            if len(sides) == 1:
                raise FinetuneError(
                    f"sample {index}: {side} goes on after the prompt with a {role} turn, not the assistant's reply; "
                    "a completion must begin with the reply: fix or remove the sample"
                )
            raise FinetuneError(
                f"sample {index}: {names} have different prompts (after the messages both share, {side} goes on with "
                f"a {role} turn, not the assistant's reply); a pair must answer the same prompt: fix or remove it"
            )
    context = [{**m, "weight": 0} if message_role(m) == _ASSISTANT and m.get("weight") is None else m for m in prompt]
    return [[*context, *completion] for completion in completions]


def _same(completions: list[list[Any]], n: int) -> bool:
    return all(completion[n] == completions[0][n] for completion in completions)


def _first_user_text(turns: list[Any]) -> str | None:
    first = next((m for m in turns if message_role(m) == _USER), None)
    if first is None:
        return None
    text = first.get("content", first.get("value"))
    return text.strip() if isinstance(text, str) else describe(text)


def encode_conversations(
    conversations: list[list[Any]],
    side: str,
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[Any] | None,
    cfg: DataConfig,
    whole: bool,
) -> list[_Side]:
    """Each side rendered as one whole conversation by the chat path that locates replies, its prompt what
    comes before the completion's first reply. Reasoning is compared unless data.train_on_reasoning=false
    keeps it as context (it stays in the ids, so both sides still share exactly the prompt)."""
    try:
        rendered = render_chats(conversations, tokenizer, True, indices, multi_turn="full", tools=tools)
    except FinetuneError as exc:
        if "cannot be located" not in str(exc):
            raise
        # SFT's advice (data.multi_turn) is not a preference run's: the two sides are compared whole.
        raise FinetuneError(
            f"{str(exc).split(';')[0]} ({side}); a pair's completion is compared as one rendering: give each side "
            "one reply after the prompt, or set data.chat_template to a template that writes every reply as it is"
        ) from None
    replies = encode_rendered(rendered, tokenizer)
    compared = replies
    if not cfg.train_on_reasoning and any(rendered.reasoning):
        compared = encode_rendered(rendered, tokenizer, train_on_reasoning=False)
    sides = []
    for ids, ranges, kept, reasoning, index in zip(replies.ids, replies.ranges, compared.ranges,
                                                   replies.reasoning_tokens, indices, strict=True):  # fmt: skip
        if not ranges:
            raise FinetuneError(
                f"sample {index}: {side} has no reply to compare (weight 0 on every reply after the prompt); "
                "remove the weights or the sample"
            )
        # What a template writes after the last reply is not compared, and kept only where the sequence is scored
        # whole (a reward model reads its score at the rendering's last token, as every reader of it does).
        first, last = ranges[0][0], len(ids) if whole else ranges[-1][1]
        trained = [False] * (last - first)
        for lo, hi in kept:
            trained[lo - first : hi - first] = [True] * (hi - lo)
        sides.append(_Side(ids[:first], ids[first:last], trained, reasoning))
    return sides


def tokenized_sources(
    parts: list[tuple[Any, datasets.Dataset]],
    wheres: list[str | None],
    cfg: DataConfig,
    tokenize: Callable[[datasets.Dataset], datasets.Dataset],
) -> datasets.Dataset:
    """Each source tokenized (a refusal named by its source; data.invalid=drop's share checked per source), then
    mixed into one dataset."""
    tokenized = []
    for (_, dataset), where in zip(parts, wheres, strict=True):
        try:
            samples = tokenize(dataset)
            if cfg.invalid == "drop":
                check_invalid_share(samples, "the data")
        except FinetuneError as exc:
            raise FinetuneError(f"{where}: {exc}" if where else str(exc)) from None
        tokenized.append(samples)
    return tokenized[0] if len(tokenized) == 1 else datasets.concatenate_datasets(tokenized)


def prepare_pairs(
    parts: list[tuple[Any, datasets.Dataset]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    wheres: list[str | None],
    first_index: int = 0,
    whole: bool = False,
) -> tuple[datasets.Dataset, PairStats]:
    """Tokenize each source's pairs, drop (and count) those too long, with equal replies or (data.invalid=drop)
    malformed, mix, and number the pairs kept from `first_index` (`pair_index`: where a precomputed reference is
    looked up)."""
    every = tokenized_sources(parts, wheres, cfg, lambda dataset: tokenize_pairs(dataset, tokenizer, cfg, whole))
    stats = PairStats.of(every, cfg.train_on_reasoning)
    if stats.num_pairs == 0:
        cut = "even with their prompt cut" if cfg.truncation == "truncate" else "(data.truncation=drop)"
        raise FinetuneError(
            f"none of the {len(every):,} pairs can be trained: {stats.num_too_long:,} do not fit data.max_length="
            f"{cfg.max_length} {cut}, {stats.num_identical:,} prefer a reply to itself, {stats.num_invalid:,} are "
            "invalid; check the data, or raise data.max_length"
        )
    with no_datasets_bars():
        kept = every.filter(lambda k, s: [a and not b for a, b in zip(k, s, strict=True)],
                            input_columns=["kept", "same"], batched=True)  # fmt: skip
        kept = kept.remove_columns(["kept", "same", "truncated", "reasoning", "invalid"])
        # add_column flattens the filter's indices first, with a bar of its own: a step of this split's tokenizing
        return kept.add_column("pair_index", list(range(first_index, first_index + len(kept)))), stats


@dataclass(frozen=True)
class PairStats:
    num_pairs: int
    num_too_long: int
    num_identical: int
    num_truncated: int
    num_invalid: int = 0
    invalid_examples: tuple[str, ...] = ()
    num_reasoning_tokens: int = 0
    reasoning_trained: bool = True

    @classmethod
    def of(cls, pairs: datasets.Dataset, reasoning_trained: bool) -> PairStats:
        table = pairs.select_columns(["kept", "same", "truncated", "reasoning", "invalid"]).with_format("arrow")[:]
        kept, same = table["kept"].to_pylist(), table["same"].to_pylist()
        reasons = [reason for reason in table["invalid"].to_pylist() if reason]
        too_long = sum(not k for k in kept) - len(reasons)
        identical = sum(k and s for k, s in zip(kept, same, strict=True))
        return cls(
            num_pairs=len(kept) - too_long - identical - len(reasons), num_too_long=too_long,
            num_identical=identical, num_truncated=sum(table["truncated"].to_pylist()), num_invalid=len(reasons),
            invalid_examples=tuple(reasons[:3]), num_reasoning_tokens=sum(table["reasoning"].to_pylist()),
            reasoning_trained=reasoning_trained,
        )  # fmt: skip

    def describe(self, split: str) -> str:
        extra = ""
        if self.num_reasoning_tokens:
            compared = "compared" if self.reasoning_trained else "context only, not compared"
            extra += f", {self.num_reasoning_tokens:,} tokens of reasoning in the replies ({compared})"
        if self.num_invalid:
            extra += f", {self.num_invalid:,} invalid dropped (first: {' | '.join(self.invalid_examples)})"
        return (
            f"{split}: {self.num_pairs:,} pairs, {self.num_truncated:,} with their prompt cut to fit, "
            f"{self.num_too_long:,} dropped as too long, {self.num_identical:,} dropped as chosen = rejected{extra}"
        )


def collate_pairs(
    rows: list[dict[str, Any]], *, max_length: int, pad_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch of pairs as model rows (`collate_sequences`): its chosen sequences, then its rejected ones
    (sequence n and n + pairs belong to pair n), with each pair's `pair_index` and `margin` column."""
    sequences = [(row["chosen_ids"], row["chosen_targets"]) for row in rows]
    sequences += [(row["rejected_ids"], row["rejected_targets"]) for row in rows]
    batch = collate_sequences(sequences, max_length=max_length, pad_id=pad_id, packing=packing)
    batch["pair_index"] = torch.tensor([row["pair_index"] for row in rows])
    batch["margin"] = torch.tensor([row.get("margin", 0.0) for row in rows], dtype=torch.float32)
    return batch


def collate_sequences(
    sequences: list[tuple[list[int], list[int]]], *, max_length: int, pad_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """Sequences (ids, targets) whose log-probabilities or scores are taken one by one, as model rows. Packed:
    spread over rows of at most `max_length` tokens (`balanced_rows`), positions restarting per sequence (attention
    stays within it); else each padded to the longest. `sequence_ids` names the sequence of each position with a
    target (-1 elsewhere); `sequence_targets` counts each one's targets; `last_index` is the last position of each
    sequence in the rows flattened (where a reward model reads its score)."""
    if packing:
        rows_of = balanced_rows([len(ids) for ids, _ in sequences], max_length)
        width = max(sum(len(sequences[n][0]) for n in members) for members in rows_of)
    else:
        rows_of = [[n] for n in range(len(sequences))]
        width = max(len(ids) for ids, _ in sequences)
    input_ids, target_ids, position_ids, sequence_ids, attention_mask = [], [], [], [], []
    last_index = [0] * len(sequences)
    for row, members in enumerate(rows_of):
        ids, targets, positions, owners = [], [], [], []
        for n in members:
            sample_ids, sample_targets = sequences[n]
            last_index[n] = row * width + len(ids) + len(sample_ids) - 1
            ids += sample_ids
            targets += sample_targets
            positions += range(len(sample_ids))
            owners += [n if t != IGNORE else -1 for t in sample_targets]
        padding = width - len(ids)
        attention_mask.append([1] * len(ids) + [0] * padding)
        input_ids.append(ids + [pad_id] * padding)
        target_ids.append(targets + [IGNORE] * padding)
        position_ids.append(positions + list(range(padding)))
        sequence_ids.append(owners + [-1] * padding)
    batch = {
        "input_ids": torch.tensor(input_ids), "target_ids": torch.tensor(target_ids),
        "sequence_ids": torch.tensor(sequence_ids),
        "sequence_targets": torch.tensor([sum(t != IGNORE for t in targets) for _, targets in sequences]),
        "last_index": torch.tensor(last_index), "num_tokens": torch.tensor(sum(len(ids) for ids, _ in sequences)),
    }  # fmt: skip
    if packing:
        batch["position_ids"] = torch.tensor(position_ids)
        batch["row_tokens"] = torch.tensor([sum(mask) for mask in attention_mask])  # the rest of a row is padding
    else:
        batch["attention_mask"] = torch.tensor(attention_mask)
    return with_host_indices(batch)


@dataclass(frozen=True)
class Pairs:
    """Preference pairs (`finetune.data.Samples`): each pair's chosen and rejected sequences batched together,
    numbered across train and eval for a precomputed reference."""

    whole: bool = False
    """Each conversation through the end of its rendering (a reward model's pairs): see `tokenize_pairs`."""
    numbered = True

    def prepare(
        self,
        parts: list[tuple[Any, datasets.Dataset]],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        seed: int,
        evaluation: bool = False,
        first_index: int = 0,
    ) -> tuple[datasets.Dataset, PairStats]:
        wheres = [source_name(source, cfg, evaluation) for source, _ in parts]
        return prepare_pairs(parts, tokenizer, cfg, wheres, first_index=first_index, whole=self.whole)

    def collate(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
        return functools.partial(collate_pairs, max_length=cfg.max_length, pad_id=tokenizer.pad_token_id,
                                 packing=cfg.packing)  # fmt: skip


PAIR_SAMPLES = Pairs()
SCORED_PAIRS = Pairs(whole=True)
"""A reward model's pairs: each conversation as `tokenizer.apply_chat_template` renders it whole, so that its last
token, where the score is read, is the one every reader of the exported model reads it at."""
