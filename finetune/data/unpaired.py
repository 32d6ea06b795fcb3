"""Unpaired feedback (KTO) -> each sample's prompt and completion tokens, its label, and a mismatched partner.

A sample is TRL's unpaired layout: `prompt` + `completion` + `label` (true: desirable, false: undesirable), the
prompt and completion as text or lists of messages (a `completion` that is a whole conversation without a `prompt`
column: all but its last reply is the prompt). Preference pairs are read too, each split into its chosen reply
(desirable) and its rejected one (undesirable), as TRL's `unpair_preference_dataset` splits them. Prompt and
completion are laid out and rendered as one side of a preference pair is (`finetune.data.preference`), so the
trained tokens are the completion's replies as the template renders them, through their end-of-turn marker.

KTO's reference point is the policy's log-ratio to the reference on completions that do not answer their prompt.
Each sample is given a partner once, when its split is prepared: the samples are put in one cycle, in an order drawn
from the data seed, and each one's mismatched sequence is its own prompt with the completion of the sample before
it in that cycle. The pairs so do not depend on the sampler, the micro-batch size or the process count, and every
completion serves once as a mismatched one. (TRL cycles completions within each device's batch, which needs a
per-device batch above 1 and sequential sampling.)

Too long for `data.max_length`: the prompt is cut from the left (its last turns kept) until the sequence fits; a
sample whose completion alone does not fit is dropped, never a completion cut in the middle. A mismatched sequence's
prompt is cut from the left to fit its partner's completion.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig
from finetune.data.chat import describe
from finetune.data.preference import (
    PAIR_COLUMNS,
    collate_sequences,
    encode_conversations,
    encode_texts,
    prompted_conversations,
    tokenized_sources,
)
from finetune.data.sources import SAMPLE_INDEX, source_name
from finetune.data.tokenize import IGNORE, map_processes
from finetune.engine.quiet import no_datasets_bars
from finetune.errors import FinetuneError

UNPAIRED_COLUMNS = ("completion", "label")
SAMPLES = datasets.Features({
    "prompt_ids": datasets.List(datasets.Value("int32")), "completion_ids": datasets.List(datasets.Value("int32")),
    "completion_targets": datasets.List(datasets.Value("int32")), "label": datasets.Value("bool"),
    "truncated": datasets.Value("bool"), "kept": datasets.Value("bool"), "reasoning": datasets.Value("int32"),
    "invalid": datasets.Value("string"),
})  # fmt: skip
"""A tokenized sample: its prompt's ids, its completion's ids and their targets (the token itself where it is
compared, else IGNORE), `label` (desirable), `truncated` (its prompt was cut), `kept` (it fits, and is valid),
`reasoning` (tokens of reasoning in the completion), `invalid` (data.invalid=drop: why it was refused, else "")."""


def tokenize_unpaired(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> datasets.Dataset:
    """Tokenize every sample (cached by `datasets` under the fingerprint of data and settings); a pair gives two."""
    columns = set(dataset.column_names)
    if not (set(UNPAIRED_COLUMNS) <= columns or set(PAIR_COLUMNS) <= columns):
        shown = sorted(columns - {SAMPLE_INDEX})
        raise FinetuneError(
            f"KTO data needs completion and label columns (and prompt, unless completion is a whole conversation), "
            f"or preference pairs' chosen and rejected; the dataset has {shown}: rename them with a columns mapping"
        )
    encode = functools.partial(_encode_samples, tokenizer=tokenizer, cfg=cfg)
    return dataset.map(
        encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc="tokenizing (KTO)",
        num_proc=map_processes(len(dataset)), features=SAMPLES,
    )  # fmt: skip


def _encode_samples(
    batch: dict[str, list], indices: list[int], *, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> dict[str, list]:
    indices = batch.pop(SAMPLE_INDEX, indices)
    try:
        return _encode_batch(batch, indices, tokenizer, cfg)
    except FinetuneError:
        if cfg.invalid != "drop":
            raise
    # data.invalid=drop: each sample alone, a refused one kept as one not kept, carrying its reason (counted, and
    # stopping the run past tokenize.MAX_INVALID_SHARE).
    out: dict[str, list] = {key: [] for key in SAMPLES}
    for n, index in enumerate(indices):
        try:
            alone = {column: values[n : n + 1] for column, values in batch.items()}
            one = _encode_batch(alone, [index], tokenizer, cfg)
        except FinetuneError as exc:
            one = {key: [[]] if key.endswith(("_ids", "_targets")) else [0] for key in SAMPLES}
            one.update(label=[False], truncated=[False], kept=[False], invalid=[str(exc)])
        for key, values in one.items():
            out[key] += values
    return out


def _encode_batch(
    batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> dict[str, list]:
    """Each sample's prompt and completion: unpaired samples as they are, pairs as their chosen then rejected side."""
    prompts = batch.get("prompt", [None] * len(indices))
    if "label" in batch:
        labels = [_label(label, index) for label, index in zip(batch["label"], indices, strict=True)]
        sides = {"completion": batch["completion"]}
    else:
        labels = [True] * len(indices) + [False] * len(indices)
        sides = {side: batch[side] for side in PAIR_COLUMNS}
    if all(isinstance(reply, str) for replies in sides.values() for reply in replies):
        encoded = [encode_texts(prompts, replies, side, indices, tokenizer, cfg) for side, replies in sides.items()]
    else:
        laid_out = [
            prompted_conversations(prompt, {side: replies[n] for side, replies in sides.items()}, index)
            for n, (prompt, index) in enumerate(zip(prompts, indices, strict=True))
        ]
        tools = batch.get("tools")
        encoded = [encode_conversations([conversations[k] for conversations in laid_out], side, indices, tokenizer,
                                        tools, cfg, whole=False) for k, side in enumerate(sides)]  # fmt: skip
    out: dict[str, list] = {key: [] for key in SAMPLES}
    for side, label in zip((s for sides_of in encoded for s in sides_of), labels, strict=True):
        room = cfg.max_length - len(side.reply)
        truncated = len(side.prompt) > room
        # At least one prompt token (the completion's first token must be somebody's target), and the whole prompt
        # unless data.truncation=truncate lets it be cut from the left (its last turns kept).
        kept = room >= 1 and (cfg.truncation == "truncate" or not truncated)
        out["prompt_ids"].append(side.prompt[max(len(side.prompt) - room, 0) :] if kept else [])
        out["completion_ids"].append(side.reply if kept else [])
        out["completion_targets"].append(side.targets() if kept else [])
        out["label"].append(label)
        out["truncated"].append(truncated and kept)
        out["kept"].append(kept)
        out["reasoning"].append(side.reasoning)
        out["invalid"].append("")
    return out


def _label(label: Any, index: int) -> bool:
    if not isinstance(label, bool):
        raise FinetuneError(
            f"sample {index}: label must be true (a desirable completion) or false (an undesirable one), got "
            f"{describe(label)}; fix or remove it"
        )
    return label


def with_partners(samples: datasets.Dataset, seed: int) -> datasets.Dataset:
    """Each sample with its mismatched partner's completion (`kl_completion_ids`, `kl_completion_targets`): the
    samples in one cycle, in an order drawn from `seed`, each taking the completion of the one before it."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    partner = [0] * len(samples)
    for position, sample in enumerate(order):
        partner[sample] = order[position - 1]  # the first one's partner is the last one
    partners = samples.select_columns(["completion_ids", "completion_targets"]).select(partner).flatten_indices()
    partners = partners.rename_columns({c: f"kl_{c}" for c in partners.column_names})
    return datasets.concatenate_datasets([samples, partners], axis=1)


def prepare_unpaired(
    parts: list[tuple[Any, datasets.Dataset]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    wheres: list[str | None],
    seed: int,
    first_index: int = 0,
    evaluation: bool = False,
) -> tuple[datasets.Dataset, UnpairedStats]:
    """Tokenize each source's samples, drop (and count) those too long or (data.invalid=drop) malformed, mix, give
    each its mismatched partner, and number them from `first_index` (`pair_index`: where a precomputed reference is
    looked up)."""
    every = tokenized_sources(parts, wheres, cfg, lambda dataset: tokenize_unpaired(dataset, tokenizer, cfg))
    stats = UnpairedStats.of(every, cfg.train_on_reasoning)
    if stats.num_samples == 0:
        cut = "even with their prompt cut" if cfg.truncation == "truncate" else "(data.truncation=drop)"
        raise FinetuneError(
            f"none of the {len(every):,} samples can be trained: {stats.num_too_long:,} do not fit data.max_length="
            f"{cfg.max_length} {cut}, {stats.num_invalid:,} are invalid; check the data, or raise data.max_length"
        )
    if not evaluation and 0 in (stats.num_desirable, stats.num_undesirable):
        missing, present = ("undesirable", "desirable") if stats.num_undesirable == 0 else ("desirable", "undesirable")
        raise FinetuneError(
            f"the training data holds {present} samples only ({stats.num_samples:,}, none with label "
            f"{str(missing == 'desirable').lower()}): KTO learns from both kinds, each against the reference point; "
            f"add {missing} samples, or train with supervised fine-tuning"
        )
    with no_datasets_bars():
        kept = every.filter(lambda k: k, input_columns=["kept"])
        kept = kept.remove_columns(["kept", "truncated", "reasoning", "invalid"]).flatten_indices()
        kept = with_partners(kept, seed)
        return kept.add_column("pair_index", list(range(first_index, first_index + len(kept)))), stats


@dataclass(frozen=True)
class UnpairedStats:
    num_desirable: int
    num_undesirable: int
    num_too_long: int
    num_truncated: int
    num_invalid: int = 0
    invalid_examples: tuple[str, ...] = ()
    num_reasoning_tokens: int = 0
    reasoning_trained: bool = True

    @property
    def num_samples(self) -> int:
        return self.num_desirable + self.num_undesirable

    @classmethod
    def of(cls, samples: datasets.Dataset, reasoning_trained: bool) -> UnpairedStats:
        table = samples.select_columns(["label", "kept", "truncated", "reasoning", "invalid"]).with_format("arrow")[:]
        labels, kept = table["label"].to_pylist(), table["kept"].to_pylist()
        reasons = [reason for reason in table["invalid"].to_pylist() if reason]
        desirable = sum(k and label for k, label in zip(kept, labels, strict=True))
        return cls(
            num_desirable=desirable, num_undesirable=sum(kept) - desirable,
            num_too_long=sum(not k for k in kept) - len(reasons), num_truncated=sum(table["truncated"].to_pylist()),
            num_invalid=len(reasons), invalid_examples=tuple(reasons[:3]),
            num_reasoning_tokens=sum(table["reasoning"].to_pylist()), reasoning_trained=reasoning_trained,
        )  # fmt: skip

    def describe(self, split: str) -> str:
        extra = ""
        if self.num_reasoning_tokens:
            compared = "trained" if self.reasoning_trained else "context only, not trained"
            extra += f", {self.num_reasoning_tokens:,} tokens of reasoning in the completions ({compared})"
        if self.num_invalid:
            extra += f", {self.num_invalid:,} invalid dropped (first: {' | '.join(self.invalid_examples)})"
        return (
            f"{split}: {self.num_samples:,} samples ({self.num_desirable:,} desirable, {self.num_undesirable:,} "
            f"undesirable), {self.num_truncated:,} with their prompt cut to fit, {self.num_too_long:,} dropped as too "
            f"long{extra}"
        )


def collate_unpaired(
    rows: list[dict[str, Any]], *, max_length: int, pad_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch of samples as model rows (`finetune.data.preference.collate_sequences`): each sample's prompt
    and completion, and under `kl_` the same keys for the mismatched sequences (each prompt with its partner's
    completion, the prompt cut from the left to fit); `label` and `pair_index` per sample."""
    matched = [_sequence(row["prompt_ids"], row["completion_ids"], row["completion_targets"], max_length)
               for row in rows]  # fmt: skip
    mismatched = [_sequence(row["prompt_ids"], row["kl_completion_ids"], row["kl_completion_targets"], max_length)
                  for row in rows]  # fmt: skip
    batch = collate_sequences(matched, max_length=max_length, pad_id=pad_id, packing=packing)
    kl = collate_sequences(mismatched, max_length=max_length, pad_id=pad_id, packing=packing)
    batch.update({f"kl_{key}": value for key, value in kl.items() if key != "num_tokens"})
    batch["label"] = torch.tensor([row["label"] for row in rows])
    batch["pair_index"] = torch.tensor([row["pair_index"] for row in rows])
    return batch


def _sequence(
    prompt: list[int], completion: list[int], targets: list[int], max_length: int
) -> tuple[list[int], list[int]]:
    """ids and next-token targets of a prompt (cut from the left to fit) followed by a completion."""
    prompt = prompt[max(len(prompt) + len(completion) - max_length, 0) :]
    return prompt + completion, [IGNORE] * (len(prompt) - 1) + targets + [IGNORE]


def kl_view(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mismatched sequences of a collated micro-batch, as a batch of their own."""
    return {key.removeprefix("kl_"): value for key, value in batch.items() if key.startswith("kl_")}


@dataclass(frozen=True)
class Unpaired:
    """KTO's samples (`finetune.data.Samples`): each with its label and mismatched partner, numbered across train
    and eval for a precomputed reference."""

    numbered = True

    def prepare(
        self,
        parts: list[tuple[Any, datasets.Dataset]],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        seed: int,
        evaluation: bool = False,
        first_index: int = 0,
    ) -> tuple[datasets.Dataset, UnpairedStats]:
        wheres = [source_name(source, cfg, evaluation) for source, _ in parts]
        return prepare_unpaired(parts, tokenizer, cfg, wheres, seed, first_index=first_index, evaluation=evaluation)

    def collate(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
        return functools.partial(collate_unpaired, max_length=cfg.max_length, pad_id=tokenizer.pad_token_id,
                                 packing=cfg.packing)  # fmt: skip


UNPAIRED_SAMPLES = Unpaired()
