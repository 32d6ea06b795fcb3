"""The batch: what a collator hands the step, defined once. The loss and the objectives import it without the data
package (and so without datasets and pyarrow)."""

from __future__ import annotations

from typing import Any, TypedDict

import torch

IGNORE = -100
"""The target of a position that does not train (a prompt, padding, a packed row's sample boundary)."""


class Batch(TypedDict, total=False):
    """A micro-batch of rows: every objective's `input_ids` and `target_ids`, padded or packed, and the extras
    its collator adds."""

    input_ids: torch.Tensor
    """(rows, length) token ids."""
    target_ids: torch.Tensor
    """(rows, length) the next token at each position, IGNORE where none trains."""
    attention_mask: torch.Tensor
    """Padded rows: 1 on real tokens. Packed rows carry none (an all-ones mask would turn the block-causal one off)."""
    position_ids: torch.Tensor
    """Packed rows: positions restarting at each sample, so attention and RoPE see samples apart."""
    shared_prompt: Any
    """Online RL's shared rows (a prompt once, then its completions: `finetune.data.rollout`): where each
    completion's queries and keys are, for the `shared_prompt` attention
    (`finetune.engine.shared_attention.Grouping`)."""
    cu_seq_lens: torch.Tensor
    """Packed rows: cumulative sample lengths over the rows flattened, for the varlen attention path."""
    kept_index: torch.Tensor
    """The positions with a target, rows flattened: found on the host, where the device would stall the host."""
    kept_targets: torch.Tensor
    """The target of each `kept_index`, where a position predicts several tokens and `target_ids` cannot say so
    (online RL's shared rows: a prompt's last token predicts each completion's first); such batches have no
    `target_ids`."""
    row_tokens: torch.Tensor
    """Real tokens per row; `num_tokens`, their sum."""
    num_tokens: torch.Tensor
    pair_index: torch.Tensor
    """Preference pairs: each pair's number over train and eval (where its precomputed reference is)."""
    sequence_ids: torch.Tensor
    """Preference pairs: the sequence (chosen ones, then rejected ones) of each position with a target, else -1."""
    sequence_targets: torch.Tensor
    """Preference pairs: each sequence's target tokens."""


def kept_positions(target_ids: torch.Tensor) -> torch.Tensor:
    """The positions of rows of `target_ids` that have a target, as indices into the rows flattened."""
    return (target_ids.reshape(-1) != IGNORE).nonzero().reshape(-1)
