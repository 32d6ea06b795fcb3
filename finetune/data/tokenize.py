"""Samples of any format -> `input_ids` plus `target_ids` (the next token where loss is taken, else IGNORE).

Shifting inside each sample (rather than inside the model) means a packed row never asks one
sample to predict the next.
"""

from __future__ import annotations

import functools
import itertools
import os

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig
from finetune.data.chat import EncodedSamples, MultiTurn, describe, encode_rendered, render_chats, unclosed_think
from finetune.data.chat.spans import UnclosedThink, think_block
from finetune.data.sources import SAMPLE_INDEX
from finetune.engine.batch import IGNORE
from finetune.errors import FinetuneError

FORMAT_COLUMNS = {
    "chat": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",),
    "preference": ("chosen", "rejected"),
}  # fmt: skip


def detect_format(columns: list[str], requested: str) -> str:
    """The sample format, from `data.format` or (for auto) from the columns present."""
    candidates = [requested] if requested != "auto" else list(FORMAT_COLUMNS)
    for name in candidates:
        if all(column in columns for column in FORMAT_COLUMNS[name]):
            return name
    expected = " or ".join("+".join(cols) for cols in (FORMAT_COLUMNS[c] for c in candidates))
    hint = "" if requested == "auto" else ", or set data.format to match the data"
    raise FinetuneError(f"dataset has columns {columns}, expected {expected}; rename the columns{hint}")


def encode_prompt_completions(
    prompts: list[str], completions: list[str], tokenizer: PreTrainedTokenizerBase, completion_only: bool
) -> list[tuple[list[int], list[bool]]]:
    """Prompt tokens (with the tokenizer's BOS if it adds one), then completion tokens and EOS."""
    prompt_ids = tokenizer(prompts)["input_ids"]
    eos = [tokenizer.eos_token_id]
    completion_ids = [ids + eos for ids in tokenizer(completions, add_special_tokens=False)["input_ids"]]
    return [
        (prompt + completion, [not completion_only] * len(prompt) + [True] * len(completion))
        for prompt, completion in zip(prompt_ids, completion_ids, strict=True)
    ]


def with_text_reasoning(
    encoded: list[tuple[list[int], list[bool]]],
    completions: list[str],
    tokenizer: PreTrainedTokenizerBase,
    indices: list[int],
    train_on_reasoning: bool,
) -> tuple[list[tuple[list[int], list[bool]]], list[int]]:
    """Text completions (`encode_prompt_completions`' samples) whose text opens with a <think> block, as chat
    replies are read: the block's text counted as reasoning, and kept as context only (in the ids, not trained)
    under data.train_on_reasoning=false. Returns the samples and each one's reasoning tokens."""
    if not any(completion.lstrip().startswith("<think>") for completion in completions):
        return encoded, [0] * len(encoded)
    offsets = tokenizer(completions, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    samples, counts = [], []
    for (ids, trained), text, spans, index in zip(encoded, completions, offsets, indices, strict=True):
        try:  # the same leading block, found the same way, as in a conversation's reply
            thought = think_block(text, 0, len(text))
        except UnclosedThink:
            raise unclosed_think(index) from None
        within = [thought is not None and a < thought[1] and b > thought[0] for a, b in spans]
        if not train_on_reasoning and any(within):
            first = len(ids) - len(spans) - 1  # the completion's first token (before it: the prompt; after: EOS)
            trained = (
                trained[:first] + [t and not w for t, w in zip(trained[first:-1], within, strict=True)] + trained[-1:]
            )
        samples.append((ids, trained))
        counts.append(sum(within))
    return samples, counts


def encode_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], list[bool]]]:
    """Plain text, all tokens trained, ending with EOS."""
    return [(ids + [tokenizer.eos_token_id], [True] * (len(ids) + 1)) for ids in tokenizer(texts)["input_ids"]]


def _texts(batch: dict[str, list], column: str, indices: list[int]) -> list[str]:
    """A text column, or a data error naming the first sample where it is not text."""
    for value, index in zip(batch[column], indices, strict=True):
        if not isinstance(value, str):
            raise FinetuneError(f"sample {index}: {column} must be text, got {describe(value)}; fix or remove it")
    return batch[column]


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str,
    max_length: int,
    completion_only: bool,
    multi_turn: MultiTurn = "full",
    train_on_reasoning: bool = True,
    drop_long: bool = False,
    drop_invalid: bool = False,
) -> dict[str, list]:
    indices = batch.pop(SAMPLE_INDEX, indices)
    encode = functools.partial(
        _encode_samples, tokenizer=tokenizer, fmt=fmt, completion_only=completion_only, multi_turn=multi_turn,
        train_on_reasoning=train_on_reasoning,
    )  # fmt: skip
    try:
        encoded, invalid = encode(batch, indices), []
    except FinetuneError:
        if not drop_invalid:
            raise
        encoded, invalid = _encode_valid(batch, indices, encode)
    input_ids, target_ids, truncated, num_targets = [], [], [], []
    for ids, ranges in zip(encoded.ids, encoded.ranges, strict=True):
        # target_ids[i] is the token after input_ids[i] when that token is trained; the last has no successor.
        targets = [IGNORE] * len(ids)
        for first, last in ranges:
            first = max(first, 1)  # the first token is nobody's target
            targets[first - 1 : last - 1] = ids[first:last]
        truncated.append(len(ids) > max_length)
        if len(ids) > max_length and drop_long:  # data.truncation=drop: nothing of it is trained (counted)
            ids, targets = [], []
        elif len(ids) > max_length:
            ids, targets = ids[:max_length], targets[: max_length - 1] + [IGNORE]
        input_ids.append(ids)
        target_ids.append(targets)
        num_targets.append(len(targets) - targets.count(IGNORE))
    return {
        "input_ids": input_ids, "target_ids": target_ids, "truncated": truncated, "num_targets": num_targets,
        "expanded": encoded.expanded, "num_reasoning": encoded.reasoning_tokens,
        # data.invalid=drop only: each sample's reason for being left out ("" for a valid one)
        **({"invalid": invalid or [""] * len(input_ids)} if drop_invalid else {}),
    }  # fmt: skip


def _encode_samples(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str,
    completion_only: bool,
    multi_turn: MultiTurn,
    train_on_reasoning: bool,
) -> EncodedSamples:
    if fmt == "chat":
        rendered = render_chats(batch["messages"], tokenizer, completion_only, indices, multi_turn, batch.get("tools"))
        return encode_rendered(rendered, tokenizer, train_on_reasoning)
    if fmt == "prompt_completion":
        prompts, completions = _texts(batch, "prompt", indices), _texts(batch, "completion", indices)
        encoded = encode_prompt_completions(prompts, completions, tokenizer, completion_only)
        encoded, reasoning = with_text_reasoning(encoded, completions, tokenizer, indices, train_on_reasoning)
        return _encoded(encoded, reasoning)
    return _encoded(encode_texts(_texts(batch, "text", indices), tokenizer))


def _encode_valid(
    batch: dict[str, list], indices: list[int], encode: functools.partial
) -> tuple[EncodedSamples, list[str]]:
    """data.invalid=drop, for a batch some sample of which was refused: each sample encoded alone, a refused one
    kept as an empty sample carrying its reason (counted, and left out with the samples nothing trains)."""
    ids, ranges, expanded, reasoning, invalid = [], [], [], [], []
    columns = [column for column in batch if column != SAMPLE_INDEX]
    for n, index in enumerate(indices):
        try:
            one = encode({column: batch[column][n : n + 1] for column in columns}, [index])
        except FinetuneError as exc:
            ids.append([])
            ranges.append([])
            expanded.append(False)
            reasoning.append(0)
            invalid.append(str(exc))
            continue
        ids += one.ids
        ranges += one.ranges
        expanded += one.expanded
        reasoning += one.reasoning_tokens
        invalid += [""] * len(one.ids)
    return EncodedSamples(ids, ranges, expanded, reasoning), invalid


def _encoded(samples: list[tuple[list[int], list[bool]]], reasoning: list[int] | None = None) -> EncodedSamples:
    """(ids, trained) pairs as columns, with each sample's reasoning tokens (none unless given)."""
    return EncodedSamples(
        [ids for ids, _ in samples],
        [_runs(trained) for _, trained in samples],
        [False] * len(samples),
        reasoning if reasoning is not None else [0] * len(samples),
    )


def _runs(trained: list[bool]) -> list[tuple[int, int]]:
    """The [first, last) ranges of consecutive trained tokens."""
    ranges, position = [], 0
    for train, group in itertools.groupby(trained):
        length = sum(1 for _ in group)
        if train:
            ranges.append((position, position + length))
        position += length
    return ranges


def tokenize(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, where: str | None = None
) -> datasets.Dataset:
    """Tokenize and mask every sample (cached by `datasets` under the fingerprint of data and settings).
    `where` names the data (e.g. "data.eval_path eval.jsonl") in data errors. Samples are named by their
    position in their file: the `SAMPLE_INDEX` column where the data was reordered, else their position here."""
    try:
        return _tokenize(dataset, tokenizer, cfg)
    except FinetuneError as exc:
        if where is None:
            raise
        raise FinetuneError(f"{where}: {exc}") from None


def _tokenize(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> datasets.Dataset:
    if len(dataset) == 0:
        raise FinetuneError(
            "the dataset is empty; point data.train_path (or the data.train source) at a file with samples"
        )
    fmt = detect_format([c for c in dataset.column_names if c != SAMPLE_INDEX], cfg.format)
    if fmt == "preference":
        raise FinetuneError(
            "the data holds preference pairs (chosen, rejected); add a preference section to train on them "
            "(e.g. preference.loss=dpo), or give supervised data"
        )
    if "label" in dataset.column_names and "completion" in dataset.column_names:
        raise FinetuneError(
            "the data holds unpaired feedback (completion, label): supervised fine-tuning would train on the "
            "undesirable completions too; add preference.loss=kto to learn from the labels, or remove the label column"
        )
    if fmt == "chat" and not tokenizer.chat_template:
        raise FinetuneError(
            "the data is chat (messages) but the tokenizer has no chat template; use an instruct model's tokenizer, "
            "or give the data as prompt/completion or text"
        )
    encode = functools.partial(
        _tokenize_batch,
        tokenizer=tokenizer,
        fmt=fmt,
        max_length=cfg.max_length,
        completion_only=cfg.completion_only_loss and fmt != "text",
        multi_turn=cfg.multi_turn,
        train_on_reasoning=cfg.train_on_reasoning,
        drop_long=cfg.truncation == "drop",
        drop_invalid=cfg.invalid == "drop",
    )
    return dataset.map(
        encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc=f"tokenizing ({fmt})",
        num_proc=map_processes(len(dataset)), features=WITH_INVALID if cfg.invalid == "drop" else TOKENIZED,
    )  # fmt: skip


TOKENIZED = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")), "target_ids": datasets.List(datasets.Value("int32")),
    "truncated": datasets.Value("bool"), "num_targets": datasets.Value("int32"), "expanded": datasets.Value("bool"),
    "num_reasoning": datasets.Value("int32"),
})  # fmt: skip
"""What tokenization writes, declared: `datasets` then infers no types from the values (a pass over every
token), and ids take 4 bytes in the cache (inferred, targets took 8)."""
WITH_INVALID = datasets.Features({**TOKENIZED, "invalid": datasets.Value("string")})
"""With data.invalid=drop, also why each sample left out was refused ("" for the others)."""


MAX_INVALID_SHARE = 0.01
"""data.invalid=drop stops a run when more than this share of one source is malformed."""


def check_invalid_share(tokenized: datasets.Dataset, where: str) -> None:
    """data.invalid=drop: stop when more of one source (`tokenized`, its "invalid" column) is malformed than a few
    bad rows would explain."""
    reasons = [reason for reason in tokenized["invalid"] if reason]
    if len(reasons) > MAX_INVALID_SHARE * len(tokenized):
        raise FinetuneError(
            f"{where}: {len(reasons):,} of its {len(tokenized):,} samples are invalid, more than data.invalid=drop "
            f"leaves out ({MAX_INVALID_SHARE:.0%}): the data or its columns mapping is wrong? First: {reasons[0]}"
        )


def map_processes(num_samples: int) -> int | None:
    """Worker processes for tokenizing `num_samples` samples: none below 50,000 (starting workers costs
    more than it saves), else one per 25,000 samples up to half the CPUs (the others run training's
    data-loading and the tokenizer's own threads)."""
    if num_samples < _PARALLEL_FROM:
        return None
    workers = min(num_samples // (_PARALLEL_FROM // 2), (os.cpu_count() or 2) // 2)
    return workers if workers > 1 else None


_PARALLEL_FROM = 50_000
