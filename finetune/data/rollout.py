"""A rollout's completions as training rows, in one of two layouts that train the same thing.

`separate`: a row per completion, its prompt then itself, right-padded: the reference layout, which every attention
implementation runs. `shared`: a row per prompt, the prompt once and then each of its completions, every
completion attending to the prompt and to itself alone (`attention.shared_prompt_mask`, from the rows'
`segment_ids`), positions counting on from the prompt's. Causal attention never lets a prompt token see what comes
after it, so the prompt's hidden states are the same for each of its completions, and the completions' tokens get
the same log-probabilities and gradients as in separate rows (tests/test_grpo.py); the prompt's forward and backward
run once per group instead of once per completion. The prompt's last token predicts each completion's first (a
position with several targets), and a completion's last token, which predicts nothing, is left out.

The mask is dense (rows x 1 x S x S): SDPA computes every score of a row whatever it masks, so a row of G long
completions costs G^2 times one completion's attention where separate rows cost G times. `shared_pays` weighs the
matmuls saved against the attention added, with the model's FLOPs (`finetune.flops`), for each micro-batch.
"""

from __future__ import annotations

import torch

from finetune.batch import IGNORE
from finetune.flops import ModelFlops


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


def shared_rows(
    prompts: list[list[int]], completions: list[list[int]], group: int, pad: int
) -> dict[str, torch.Tensor]:
    """One row per prompt: the prompt (segment 0), then each completion but its last token (segments 1, 2, ...),
    right-padded (segment -1). `prompts` holds each prompt once per completion, `group` completions in a row. The
    prompt's last token predicts every completion's first, so the targets are given as `kept_index` (positions,
    rows flattened, one repeated per completion) and `kept_targets`, completion by completion as `separate_rows`
    orders them; there are no `target_ids`."""
    rows, predicted = [], []
    for start in range(0, len(prompts), group):
        prompt = prompts[start]
        ids, positions, segments = list(prompt), list(range(len(prompt))), [0] * len(prompt)
        where: list[tuple[int, int]] = []  # (position in the row, target) of each completion token
        for n, completion in enumerate(completions[start : start + group], start=1):
            where += [(len(prompt) - 1, completion[0])] + [(len(ids) + j, t) for j, t in enumerate(completion[1:])]
            ids += completion[:-1]
            positions += range(len(prompt), len(prompt) + len(completion) - 1)
            segments += [n] * (len(completion) - 1)
        rows.append((ids, positions, segments))
        predicted.append(where)
    width = max(len(ids) for ids, *_ in rows)
    keys: dict[str, list] = {"input_ids": [], "position_ids": [], "segment_ids": [], "attention_mask": []}
    for ids, positions, segments in rows:
        padding = width - len(ids)
        keys["input_ids"].append(ids + [pad] * padding)
        keys["position_ids"].append(positions + [0] * padding)
        keys["segment_ids"].append(segments + [-1] * padding)
        keys["attention_mask"].append([1] * len(ids) + [0] * padding)
    kept = [(row * width + position, target) for row, where in enumerate(predicted) for position, target in where]
    return {key: torch.tensor(values) for key, values in keys.items()} | {
        "kept_index": torch.tensor([position for position, _ in kept]),
        "kept_targets": torch.tensor([target for _, target in kept]),
    }


def shared_pays(flops: ModelFlops, prompts: list[list[int]], completions: list[list[int]], group: int) -> bool:
    """Whether shared rows cost fewer FLOPs than separate ones for these completions, counting what the kernels
    compute: the matmuls over every position of the padded rows, and every score of each row's square (both
    layouts run SDPA with a mask: separate rows have padding)."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    shared = [
        len(prompts[start]) - 1 + sum(len(c) for c in completions[start : start + group])
        for start in range(0, len(prompts), group)
    ]

    def cost(rows: int, width: int) -> float:
        # flops.per_squared_length * n^2 is causal attention's half of the square, fore and back.
        return rows * (flops.per_token * width + 2 * flops.per_squared_length * width**2)

    return cost(len(shared), max(shared)) < cost(len(lengths), max(lengths))
