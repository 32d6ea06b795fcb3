"""A rollout's completions as training rows, in one of two layouts that train the same thing.

`separate`: a row per completion, its prompt then itself, right-padded: the reference layout, which every attention
implementation runs. `shared`: a row per prompt, the prompt once and then each of its completions, positions
counting on from the prompt's, each completion attending to the prompt and to itself alone
(`finetune.engine.shared_attention`, the model's attention while the GRPO objective trains an SDPA model). Causal
attention never lets a prompt token see what comes after it, so the prompt's hidden states are the same for each
of its completions, and the completions' tokens get the same log-probabilities and gradients as in separate rows
(tests/test_grpo.py); the prompt's forward and backward run once per group instead of once per completion, and
attention computes what separate rows would. The prompt's last token predicts each completion's first (a
position with several targets), and a completion's last token, which predicts nothing, is left out.
"""

from __future__ import annotations

import torch

from finetune.engine.batch import IGNORE
from finetune.engine.shared_attention import grouping


def separate_rows(prompts: list[list[int]], completions: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    """One row per completion (each with its own prompt): input_ids, target_ids and attention_mask."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    input_ids, target_ids, mask = [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = prompt + completion
        padding = width - len(ids)
        input_ids.append(ids + [pad] * padding)
        target_ids.append([IGNORE] * (len(prompt) - 1) + completion + [IGNORE] * (padding + 1))
        mask.append([1] * len(ids) + [0] * padding)
    return {"input_ids": torch.tensor(input_ids), "target_ids": torch.tensor(target_ids),
            "attention_mask": torch.tensor(mask)}  # fmt: skip


def shared_rows(prompts: list[list[int]], completions: list[list[int]], group: int, pad: int) -> dict:
    """One row per prompt: the prompt, then each completion but its last token, right-padded. `prompts` holds each
    prompt once per completion, `group` completions in a row. The prompt's last token predicts every completion's
    first, so the targets are given as `kept_index` (positions, rows flattened, one repeated per completion) and
    `kept_targets`, completion by completion as `separate_rows` orders them; there are no `target_ids`. With
    input_ids, position_ids and attention_mask (1 on real tokens), `shared_prompt`: where attention finds each
    completion's queries and keys (`finetune.engine.shared_attention.Grouping`)."""
    rows, segments, predicted = [], [], []
    for start in range(0, len(prompts), group):
        prompt = prompts[start]
        ids, positions = list(prompt), list(range(len(prompt)))
        where: list[tuple[int, int]] = []  # (position in the row, target) of each completion token
        spans: list[tuple[int, int]] = []  # each completion's segment: its first position in the row, its length
        for completion in completions[start : start + group]:
            spans.append((len(ids), len(completion) - 1))
            where += [(len(prompt) - 1, completion[0])] + [(len(ids) + j, t) for j, t in enumerate(completion[1:])]
            ids += completion[:-1]
            positions += range(len(prompt), len(prompt) + len(completion) - 1)
        rows.append((ids, positions))
        segments.append(spans)
        predicted.append(where)
    width = max(len(ids) for ids, _ in rows)
    keys: dict[str, list] = {"input_ids": [], "position_ids": [], "attention_mask": []}
    for ids, positions in rows:
        padding = width - len(ids)
        keys["input_ids"].append(ids + [pad] * padding)
        keys["position_ids"].append(positions + [0] * padding)
        keys["attention_mask"].append([1] * len(ids) + [0] * padding)
    kept = [(row * width + position, target) for row, where in enumerate(predicted) for position, target in where]
    return {key: torch.tensor(values) for key, values in keys.items()} | {
        "kept_index": torch.tensor([position for position, _ in kept]),
        "kept_targets": torch.tensor([target for _, target in kept]),
        "shared_prompt": grouping(width, [len(prompts[start]) for start in range(0, len(prompts), group)], segments),
    }


def reply_prompts(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """The prompt of each sample of a batch of supervised rows (packed: samples told apart by `position_ids`
    restarting; or padded), in order: its tokens up to the position that predicts its last reply's first token,
    that is everything before the last run of trained targets. A sample that trains nothing has none."""
    input_ids, target_ids = batch["input_ids"].tolist(), batch["target_ids"].tolist()
    if "row_tokens" in batch:
        lengths = batch["row_tokens"].tolist()
    elif "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(dim=1).tolist()
    else:
        lengths = [len(row) for row in input_ids]
    positions = batch["position_ids"].tolist() if "position_ids" in batch else None
    prompts = []
    for row, length in enumerate(lengths):
        starts = [0] if positions is None else [p for p in range(length) if positions[row][p] == 0]
        for start, end in zip(starts, [*starts[1:], length], strict=True):
            trained = [p for p in range(start, end) if target_ids[row][p] != IGNORE]
            if not trained:
                continue
            first = trained[-1]
            while first - 1 >= start and target_ids[row][first - 1] != IGNORE:
                first -= 1
            prompts.append(input_ids[row][start : first + 1])
    return prompts
