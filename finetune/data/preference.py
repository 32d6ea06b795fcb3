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
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from finetune.chatter import no_datasets_bars
from finetune.config import DataConfig
from finetune.data.chat import describe, encode_rendered, render_chats
from finetune.data.pack import with_host_indices
from finetune.data.sources import SAMPLE_INDEX
from finetune.data.tokenize import IGNORE, encode_prompt_completions, map_processes
from finetune.errors import FinetuneError

PAIR_COLUMNS = ("chosen", "rejected")
PAIRS = datasets.Features({
    "chosen_ids": datasets.List(datasets.Value("int32")), "chosen_targets": datasets.List(datasets.Value("int32")),
    "rejected_ids": datasets.List(datasets.Value("int32")),
    "rejected_targets": datasets.List(datasets.Value("int32")),
    "truncated": datasets.Value("bool"), "kept": datasets.Value("bool"), "same": datasets.Value("bool"),
})  # fmt: skip
"""A tokenized pair: each side's ids and targets (the next token where loss is taken, else IGNORE); `truncated`
(its prompt was cut), `kept` (both sides fit), `same` (chosen equals rejected: dropped)."""


def tokenize_pairs(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> datasets.Dataset:
    """Tokenize every pair (cached by `datasets` under the fingerprint of data and settings)."""
    missing = [column for column in PAIR_COLUMNS if column not in dataset.column_names]
    if missing:
        columns = [c for c in dataset.column_names if c != SAMPLE_INDEX]
        raise FinetuneError(
            f"preference data needs chosen and rejected columns (and prompt, unless chosen and rejected are whole "
            f"conversations); the dataset has {columns}: rename them with a columns mapping"
        )
    encode = functools.partial(_encode_pairs, tokenizer=tokenizer, max_length=cfg.max_length)
    return dataset.map(
        encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc="tokenizing (preference)",
        num_proc=map_processes(len(dataset)), features=PAIRS,
    )  # fmt: skip


def _encode_pairs(
    batch: dict[str, list], indices: list[int], *, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> dict[str, list]:
    indices = batch.pop(SAMPLE_INDEX, indices)
    prompts = batch.get("prompt", [None] * len(indices))
    tools = batch.get("tools")  # per sample, given to the template for both sides
    sides = {}
    for side in PAIR_COLUMNS:
        sides[side] = _encode_side(prompts, batch[side], side, indices, tokenizer, tools)
    out: dict[str, list] = {key: [] for key in PAIRS}
    for n, index in enumerate(indices):
        (chosen, chosen_start), (rejected, rejected_start) = sides["chosen"][n], sides["rejected"][n]
        if chosen[:chosen_start] != rejected[:rejected_start]:
            raise FinetuneError(
                f"sample {index}: chosen and rejected have different prompts (their texts before the replies differ "
                "once rendered); a pair must answer the same prompt: fix or remove it"
            )
        same = chosen[chosen_start:] == rejected[rejected_start:]
        prompt = chosen[:chosen_start]
        reply_chosen, reply_rejected = chosen[chosen_start:], rejected[rejected_start:]
        room = max_length - max(len(reply_chosen), len(reply_rejected))
        kept = room >= 1  # at least one prompt token: the first reply token must be somebody's target
        truncated = len(prompt) > room
        if kept and truncated:
            prompt = prompt[len(prompt) - room :]
        for side, reply in (("chosen", reply_chosen), ("rejected", reply_rejected)):
            ids = prompt + reply if kept else []
            out[f"{side}_ids"].append(ids)
            out[f"{side}_targets"].append([IGNORE] * (len(prompt) - 1) + reply + [IGNORE] if kept else [])
        out["truncated"].append(truncated and kept)
        out["kept"].append(kept)
        out["same"].append(same)
    return out


def _encode_side(
    prompts: list[Any],
    replies: list[Any],
    side: str,
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[Any] | None = None,
) -> list[tuple[list[int], int]]:
    """Each sample's ids for one side, and where its reply starts (its prompt is what comes before)."""
    if all(isinstance(reply, str) for reply in replies):
        for prompt, index in zip(prompts, indices, strict=True):
            if not isinstance(prompt, str):
                raise FinetuneError(
                    f"sample {index}: {side} is text, so prompt must be text too, got {describe(prompt)}; fix or "
                    "remove the sample"
                )
        encoded = encode_prompt_completions(prompts, replies, tokenizer, completion_only=True)
        return [(ids, trained.index(True)) for ids, trained in encoded]
    conversations = []
    for prompt, reply, index in zip(prompts, replies, indices, strict=True):
        if not isinstance(reply, list):
            raise FinetuneError(
                f"sample {index}: {side} must be a list of messages or text, got {describe(reply)}; fix or remove it"
            )
        last = reply[-1] if reply else None
        if not (isinstance(last, dict) and (last.get("role") or last.get("from")) in ("assistant", "gpt")):
            raise FinetuneError(
                f"sample {index}: {side} must end with the assistant reply that is preferred or not, got "
                f"{describe(last)}; fix or remove the sample"
            )
        # A prompt given as messages comes before the reply's; given as text beside whole conversations
        # (ultrafeedback_binarized), it is their first turn again.
        conversations.append([*prompt, *reply] if isinstance(prompt, list) else reply)
    rendered = render_chats(conversations, tokenizer, True, indices, multi_turn="last", tools=tools)
    encoded = encode_rendered(rendered, tokenizer)
    starts = []
    for ids, ranges in zip(encoded.ids, encoded.ranges, strict=True):
        first, last = ranges[-1]  # the last reply, through its end-of-turn marker
        starts.append(first)
        del ids[last:]  # what a template writes after the last reply (a final newline) is neither trained nor needed
    return list(zip(encoded.ids, starts, strict=True))


def pair_stats(pairs: datasets.Dataset) -> tuple[int, int, int]:
    """(pairs kept, dropped as too long, dropped as chosen equal to rejected)."""
    table = pairs.select_columns(["kept", "same"]).with_format("arrow")[:]
    kept, same = table["kept"].to_pylist(), table["same"].to_pylist()
    too_long = sum(not k for k in kept)
    identical = sum(k and s for k, s in zip(kept, same, strict=True))
    return len(kept) - too_long - identical, too_long, identical


def prepare_pairs(
    parts: list[tuple[Any, datasets.Dataset]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    wheres: list[str | None],
    first_index: int = 0,
) -> tuple[datasets.Dataset, PairStats]:
    """Tokenize each source's pairs, drop (and count) those too long or with equal replies, mix, and number
    the pairs kept from `first_index` (`pair_index`: where a precomputed reference is looked up)."""
    tokenized = []
    for (_, dataset), where in zip(parts, wheres, strict=True):
        try:
            tokenized.append(tokenize_pairs(dataset, tokenizer, cfg))
        except FinetuneError as exc:
            raise FinetuneError(f"{where}: {exc}" if where else str(exc)) from None
    every = tokenized[0] if len(tokenized) == 1 else datasets.concatenate_datasets(tokenized)
    stats = PairStats(*pair_stats(every), sum(every["truncated"]))
    if stats.num_pairs == 0:
        raise FinetuneError(
            f"none of the {len(every):,} pairs can be trained: {stats.num_too_long:,} do not fit data.max_length="
            f"{cfg.max_length} even with their prompt cut, {stats.num_identical:,} prefer a reply to itself; check "
            "the data, or raise data.max_length"
        )
    with no_datasets_bars():
        kept = every.filter(lambda k, s: [a and not b for a, b in zip(k, s, strict=True)],
                            input_columns=["kept", "same"], batched=True)  # fmt: skip
    kept = kept.remove_columns(["kept", "same", "truncated"])
    return kept.add_column("pair_index", list(range(first_index, first_index + len(kept)))), stats


@dataclass(frozen=True)
class PairStats:
    num_pairs: int
    num_too_long: int
    num_identical: int
    num_truncated: int

    def describe(self, split: str) -> str:
        return (
            f"{split}: {self.num_pairs:,} pairs, {self.num_truncated:,} with their prompt cut to fit, "
            f"{self.num_too_long:,} dropped as too long, {self.num_identical:,} dropped as chosen = rejected"
        )


def collate_pairs(
    rows: list[dict[str, Any]], *, max_length: int, pad_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch of pairs as model rows: its chosen sequences, then its rejected ones (sequence n and
    n + pairs belong to pair n). Packed: sequences placed first-fit in decreasing length into rows of
    `max_length` tokens, positions restarting per sequence (attention stays within it); else each padded
    to the longest. `sequence_ids` names the sequence of each position with a target (-1 elsewhere)."""
    sequences = [(row["chosen_ids"], row["chosen_targets"]) for row in rows]
    sequences += [(row["rejected_ids"], row["rejected_targets"]) for row in rows]
    if packing:
        rows_of: list[list[int]] = []
        room: list[int] = []
        for n in sorted(range(len(sequences)), key=lambda n: -len(sequences[n][0])):
            length = len(sequences[n][0])
            fit = next((r for r, free in enumerate(room) if free >= length), None)
            if fit is None:
                rows_of.append([n])
                room.append(max_length - length)
            else:
                rows_of[fit].append(n)
                room[fit] -= length
        width = max_length
    else:
        rows_of = [[n] for n in range(len(sequences))]
        width = max(len(ids) for ids, _ in sequences)
    input_ids, target_ids, position_ids, sequence_ids, attention_mask = [], [], [], [], []
    for members in rows_of:
        ids, targets, positions, owners = [], [], [], []
        for n in members:
            sample_ids, sample_targets = sequences[n]
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
        "pair_index": torch.tensor([row["pair_index"] for row in rows]),
        "num_tokens": torch.tensor(sum(len(ids) for ids, _ in sequences)),
    }  # fmt: skip
    if packing:
        batch["position_ids"] = torch.tensor(position_ids)
        batch["row_tokens"] = torch.tensor([sum(mask) for mask in attention_mask])  # the rest of a row is padding
    else:
        batch["attention_mask"] = torch.tensor(attention_mask)
    return with_host_indices(batch)
