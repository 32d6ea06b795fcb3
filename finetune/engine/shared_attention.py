"""Attention over rows that hold a prompt once and then its completions (online RL's shared rows,
`finetune.data.rollout`): `attn_implementation` "shared_prompt", set by the GRPO objective on an SDPA model.

A completion attends to its prompt and to itself alone. As one dense mask over the row, SDPA would compute every
score of the row's square: a row of G completions of n tokens would cost G^2 n^2, where rows of their own cost G n^2.
Here each completion's queries are gathered with its own keys and values, the prompt's and its segment's, into a
batch of short rows (one per completion, right-padded), and the prompt's queries attend causally within the prompt:
two SDPA calls, each computing only what rows of their own would, and the outputs scattered back to the row's
positions. The gathers and the scatter are index operations, so autograd carries the gradients of the prompt's keys
and values back from every completion that read them. The completions' part is recomputed in backward rather than
kept: what it would keep, each completion's copy of its prompt's keys and values, is the size sharing saves.

Batches without the grouping (`Grouping`, passed to the model as the `shared_prompt` keyword and from there to each
attention layer) run transformers' SDPA with its usual mask: the objective's separate rows, evaluation, generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

NAME = "shared_prompt"


@dataclass(frozen=True)
class Grouping:
    """Where each completion's queries and keys are in the rows (positions into the rows flattened), found on the
    host as the rows are built."""

    prompt_length: int
    """The longest prompt: the prompts' causal attention runs over each row's first this many positions."""
    queries: torch.Tensor
    """(completions, segment) each completion's segment positions, padded with 0."""
    keys: torch.Tensor
    """(completions, prompt_length + segment) its prompt's positions then its segment's, padded with 0."""
    mask: torch.Tensor
    """(completions, 1, segment, prompt_length + segment) which of those keys each query attends; a padded query
    attends the row's first token alone (a query that sees nothing makes SDPA's softmax NaN)."""
    output: torch.Tensor
    """(rows x length,) for each position, where its output is in the prompts' outputs (rows x prompt_length)
    followed by the completions' (completions x segment)."""

    def to(self, device: torch.device) -> Grouping:
        return Grouping(self.prompt_length, *(t.to(device, non_blocking=True) for t in
                                              (self.queries, self.keys, self.mask, self.output)))  # fmt: skip


def grouping(width: int, prompts: list[int], segments: list[list[tuple[int, int]]]) -> Grouping:
    """The grouping of rows `width` wide whose row r starts with a prompt of `prompts[r]` tokens and holds the
    completions `segments[r]`, each as (its first position, its length) in the row."""
    longest_prompt = max(prompts)
    completions = [(r, start, length) for r, row in enumerate(segments) for start, length in row]
    longest = max(1, max(length for _, _, length in completions))
    queries = torch.zeros(len(completions), longest, dtype=torch.long)
    keys = torch.zeros(len(completions), longest_prompt + longest, dtype=torch.long)
    mask = torch.zeros(len(completions), 1, longest, longest_prompt + longest, dtype=torch.bool)
    output = torch.zeros(len(prompts) * width, dtype=torch.long)
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    for r, length in enumerate(prompts):
        output[r * width : r * width + length] = torch.arange(length) + r * longest_prompt
    for c, (r, start, length) in enumerate(completions):
        positions = r * width + start + torch.arange(length)
        queries[c, :length] = positions
        keys[c, : prompts[r]] = r * width + torch.arange(prompts[r])
        keys[c, longest_prompt : longest_prompt + length] = positions
        mask[c, 0, :length, : prompts[r]] = True
        mask[c, 0, :length, longest_prompt : longest_prompt + length] = causal[:length, :length]
        mask[c, 0, length:, 0] = True
        output[positions] = len(prompts) * longest_prompt + c * longest + torch.arange(length)
    return Grouping(longest_prompt, queries, keys, mask, output)


def register() -> None:
    """Make `attn_implementation="shared_prompt"` known to transformers (idempotent), with SDPA's mask for the
    batches that carry no grouping."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, shared_prompt_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    shared_prompt: Grouping | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Query, key and value are (rows, heads, length, head_dim); returns (rows, length, heads, head_dim)."""
    if shared_prompt is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key and value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    grouping, prompt = shared_prompt, shared_prompt.prompt_length
    prompts = F.scaled_dot_product_attention(
        query[:, :, :prompt], key[:, :, :prompt], value[:, :, :prompt], is_causal=True, scale=scaling
    )
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and not _saved_elsewhere():
        # Recomputed in backward rather than kept: the kernel would save each completion's gathered copy of its
        # prompt's keys and values, completions x prompt positions, the size that sharing the prompt saves
        # everywhere else. Recomputing costs the gathers and this kernel's forward once more (2-5% of a forward
        # and backward on the GRPO bench's rows, for a quarter of their activations at prompts of 150 tokens).
        # Nothing in it is random (no attention dropout: `attention.unsupported`): no RNG state to keep. A compiled
        # layer (regional compilation) is left to AOTAutograd's partitioner, which chooses what its graph keeps.
        completions = checkpoint(_completions, query, key, value, grouping, scaling, use_reentrant=False,
                                 preserve_rng_state=False)  # fmt: skip
    else:
        completions = _completions(query, key, value, grouping, scaling)
    rows, heads, length, dim = query.shape
    outputs = torch.cat([prompts.transpose(1, 2).reshape(-1, heads, dim),
                         completions.transpose(1, 2).reshape(-1, heads, dim)])  # fmt: skip
    return outputs.index_select(0, grouping.output).view(rows, length, heads, dim), None


def _completions(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grouping: Grouping, scaling: float | None
) -> torch.Tensor:
    """Each completion's attention over its prompt and its own segment: (completions, heads, segment, dim)."""
    return F.scaled_dot_product_attention(
        _gather(query, grouping.queries), _gather(key, grouping.keys), _gather(value, grouping.keys),
        attn_mask=grouping.mask, scale=scaling,
    )  # fmt: skip


def _saved_elsewhere() -> bool:
    """Whether what this forward saves for backward already goes through saved-tensor hooks: an enclosing
    activation checkpoint (the layer's whole forward recomputed in backward, `train.activation_checkpointing`) or
    activation offload. Checkpointing the completions' attention inside it again would recompute it twice and
    save nothing. torch has no public query for this; without its private one, the attention is checkpointed."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(True) is not None


def _gather(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(rows, heads, length, dim) states at `positions` (n, m) of the rows flattened: (n, heads, m, dim)."""
    rows, heads, length, dim = states.shape
    flat = states.transpose(1, 2).reshape(rows * length, heads, dim)
    return flat.index_select(0, positions.reshape(-1)).view(*positions.shape, heads, dim).transpose(1, 2)
