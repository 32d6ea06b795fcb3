"""Datasets -> tokenized samples with loss targets -> packed or padded batches.

Every sample becomes `input_ids` plus `target_ids`, where `target_ids[i]` is the token the model
must predict after `input_ids[i]`, or IGNORE where no loss is taken. Shifting inside each sample
(rather than inside the model) means a packed row never asks one sample to predict the next.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig
from finetune.errors import FinetuneError, first_line

IGNORE = -100
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMAT_COLUMNS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


@dataclass(frozen=True)
class DataStats:
    """What tokenization did to one split; logged so that truncation is never silent."""

    num_samples: int
    num_truncated: int
    num_dropped: int
    num_tokens: int
    num_target_tokens: int
    num_rows: int

    def describe(self, split: str) -> str:
        return (
            f"{split}: {self.num_samples:,} samples, {self.num_tokens:,} tokens ({self.num_target_tokens:,} trained), "
            f"{self.num_truncated:,} truncated, {self.num_dropped:,} dropped with no target token, "
            f"{self.num_rows:,} rows"
        )


def load_split(path: str, split: str) -> datasets.Dataset:
    """A split from a local json/jsonl/csv/parquet file or folder, or from the hub."""
    local = Path(path)
    try:
        if local.is_file():
            builder = LOCAL_BUILDERS.get(local.suffix)
            if builder is None:
                raise FinetuneError(f"{path}: unsupported file type; use one of {', '.join(LOCAL_BUILDERS)}")
            return datasets.load_dataset(builder, data_files=str(local), split="train")
        return datasets.load_dataset(path, split=split)
    except FinetuneError:
        raise
    except Exception as exc:  # datasets raises many types for missing files, bad JSON, no network
        raise FinetuneError(
            f"cannot load dataset {path!r} split {split!r}: {first_line(exc)}; check data.train_path / data.eval_path"
        ) from None


def detect_format(columns: list[str], requested: str) -> str:
    """The sample format, from `data.format` or (for auto) from the columns present."""
    candidates = [requested] if requested != "auto" else list(FORMAT_COLUMNS)
    for name in candidates:
        if all(column in columns for column in FORMAT_COLUMNS[name]):
            return name
    expected = " or ".join("+".join(cols) for cols in (FORMAT_COLUMNS[c] for c in candidates))
    hint = "" if requested == "auto" else ", or set data.format to match the data"
    raise FinetuneError(f"dataset has columns {columns}, expected {expected}; rename the columns{hint}")


def encode_chats(
    conversations: list[list[dict[str, str]]], tokenizer: PreTrainedTokenizerBase, completion_only: bool
) -> list[tuple[list[int], list[bool]]]:
    """Render each conversation with the chat template; mark the assistant turns (with their end-of-turn) as trained.

    Assistant spans are found in characters, by rendering each conversation prefix, and mapped to
    tokens through the fast tokenizer's offsets, so merges across turn boundaries cannot shift them.
    The texts are tokenized in one call: the fast tokenizer is entered once per batch, not per sample.
    """
    texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
    encodings = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=completion_only)
    if not completion_only:
        return [(ids, [True] * len(ids)) for ids in encodings["input_ids"]]
    encoded = []
    for messages, text, ids, offsets in zip(
        conversations, texts, encodings["input_ids"], encodings["offset_mapping"], strict=True
    ):
        spans = _assistant_spans(messages, text, tokenizer)
        encoded.append((ids, [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]))
    return encoded


def _assistant_spans(
    messages: list[dict[str, str]], text: str, tokenizer: PreTrainedTokenizerBase
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, the rendered conversation."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        # Through the last message is the whole conversation: one render fewer per sample.
        through = text if i == len(messages) - 1 else tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise FinetuneError(
                "this tokenizer's chat template renders a conversation differently from its prefixes, so assistant "
                "tokens cannot be located; set data.completion_only_loss=false"
            )
        spans.append((len(before), len(through)))
    return spans


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


def encode_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], list[bool]]]:
    """Plain text, all tokens trained, ending with EOS."""
    return [(ids + [tokenizer.eos_token_id], [True] * (len(ids) + 1)) for ids in tokenizer(texts)["input_ids"]]


def _tokenize_batch(
    batch: dict[str, list], *, tokenizer: PreTrainedTokenizerBase, fmt: str, max_length: int, completion_only: bool
) -> dict[str, list]:
    if fmt == "chat":
        encoded = encode_chats(batch["messages"], tokenizer, completion_only)
    elif fmt == "prompt_completion":
        encoded = encode_prompt_completions(batch["prompt"], batch["completion"], tokenizer, completion_only)
    else:
        encoded = encode_texts(batch["text"], tokenizer)
    out: dict[str, list] = {"input_ids": [], "target_ids": [], "truncated": [], "num_targets": []}
    for ids, trained in encoded:
        out["truncated"].append(len(ids) > max_length)
        ids, trained = ids[:max_length], trained[:max_length]
        # target_ids[i] is the token after input_ids[i] when that token is trained; the last has no successor.
        targets = [ids[i + 1] if trained[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
        out["input_ids"].append(ids)
        out["target_ids"].append(targets)
        out["num_targets"].append(sum(target != IGNORE for target in targets))
    return out


def tokenize(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> datasets.Dataset:
    """Tokenize and mask every sample (cached by `datasets` under the fingerprint of data and settings)."""
    if len(dataset) == 0:
        raise FinetuneError("the dataset is empty; point data.train_path at a file with samples")
    fmt = detect_format(dataset.column_names, cfg.format)
    encode = functools.partial(
        _tokenize_batch,
        tokenizer=tokenizer,
        fmt=fmt,
        max_length=cfg.max_length,
        completion_only=cfg.completion_only_loss and fmt != "text",
    )
    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc=f"tokenizing ({fmt})")


def pack(dataset: datasets.Dataset, max_length: int, pad_id: int) -> datasets.Dataset:
    """Greedily concatenate samples into rows of exactly `max_length` tokens.

    `position_ids` restart at 0 for each sample; transformers reads those restarts as sequence
    boundaries and builds a block-causal mask, so attention does not cross samples either.
    """
    return dataset.map(
        functools.partial(_pack_batch, max_length=max_length, pad_id=pad_id),
        batched=True,
        batch_size=2000,
        remove_columns=dataset.column_names,
        desc="packing",
    )


def _pack_batch(batch: dict[str, list], *, max_length: int, pad_id: int) -> dict[str, list]:
    rows: dict[str, list] = {"input_ids": [], "target_ids": [], "position_ids": [], "num_tokens": []}
    ids: list[int] = []
    targets: list[int] = []
    positions: list[int] = []

    def flush() -> None:
        padding = max_length - len(ids)
        rows["input_ids"].append(ids + [pad_id] * padding)
        rows["target_ids"].append(targets + [IGNORE] * padding)
        rows["position_ids"].append(positions + list(range(padding)))
        rows["num_tokens"].append(len(ids))

    for sample_ids, sample_targets in zip(batch["input_ids"], batch["target_ids"], strict=True):
        if len(ids) + len(sample_ids) > max_length:
            flush()
            ids, targets, positions = [], [], []
        ids.extend(sample_ids)
        targets.extend(sample_targets)
        positions.extend(range(len(sample_ids)))
    if ids:
        flush()
    return rows


def collate_packed(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "target_ids", "position_ids")}
    batch["num_tokens"] = torch.tensor(sum(row["num_tokens"] for row in rows))
    return batch


def collate_padded(rows: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample in the batch."""
    length = max(len(row["input_ids"]) for row in rows)
    batch: dict[str, list] = {"input_ids": [], "target_ids": [], "attention_mask": []}
    for row in rows:
        padding = length - len(row["input_ids"])
        batch["input_ids"].append(row["input_ids"] + [pad_id] * padding)
        batch["target_ids"].append(row["target_ids"] + [IGNORE] * padding)
        batch["attention_mask"].append([1] * len(row["input_ids"]) + [0] * padding)
    tensors = {key: torch.tensor(value) for key, value in batch.items()}
    tensors["num_tokens"] = tensors["attention_mask"].sum()
    return tensors


def prepare_split(
    raw: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, seed: int
) -> tuple[datasets.Dataset, DataStats]:
    """Tokenize, drop samples left with nothing to train on, and pack (after a seeded shuffle) if asked."""
    tokenized = tokenize(raw, tokenizer, cfg)
    kept = tokenized.filter(lambda counts: [n > 0 for n in counts], input_columns="num_targets", batched=True)
    rows = pack(kept.shuffle(seed=seed), cfg.max_length, tokenizer.pad_token_id) if cfg.packing else kept
    # Counted in Arrow, without turning every sample into Python lists.
    table = tokenized.with_format("arrow")[:]
    num_targets = table["num_targets"].to_numpy()
    lengths = pyarrow.compute.list_value_length(table["input_ids"]).to_numpy()
    stats = DataStats(
        num_samples=len(tokenized),
        num_truncated=int(pyarrow.compute.sum(table["truncated"]).as_py() or 0),
        num_dropped=len(tokenized) - len(kept),
        num_tokens=int(lengths[num_targets > 0].sum()),
        num_target_tokens=int(num_targets.sum()),
        num_rows=len(rows),
    )
    return rows, stats


@dataclass
class Data:
    train_loader: DataLoader
    eval_loader: DataLoader | None
    train_stats: DataStats
    eval_stats: DataStats | None


def build_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, accelerator: Accelerator, *, seed: int, micro_batch_size: int
) -> Data:
    """Train and eval dataloaders (not yet prepared). The main process tokenizes first; the others hit its cache."""
    with accelerator.main_process_first():
        train_raw = load_split(cfg.train_path, cfg.train_split)
        eval_raw = load_split(cfg.eval_path, cfg.eval_split) if cfg.eval_path else None
        if eval_raw is None and cfg.eval_fraction > 0:
            split = train_raw.train_test_split(test_size=cfg.eval_fraction, seed=seed)
            train_raw, eval_raw = split["train"], split["test"]
        train_rows, train_stats = prepare_split(train_raw, tokenizer, cfg, seed)
        eval_rows, eval_stats = prepare_split(eval_raw, tokenizer, cfg, seed) if eval_raw is not None else (None, None)
    needed = micro_batch_size * accelerator.num_processes
    if len(train_rows) < needed:
        raise FinetuneError(
            f"the training data yields {len(train_rows)} rows but one step needs micro_batch_size x processes = "
            f"{needed}; add data or lower train.micro_batch_size"
        )
    collate = collate_packed if cfg.packing else functools.partial(collate_padded, pad_id=tokenizer.pad_token_id)
    train_loader = DataLoader(
        train_rows,
        batch_size=micro_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
    )
    eval_loader = None
    if eval_rows is not None and len(eval_rows) > 0:
        eval_loader = DataLoader(eval_rows, batch_size=micro_batch_size, collate_fn=collate)
    return Data(train_loader, eval_loader, train_stats, eval_stats)
