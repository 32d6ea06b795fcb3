"""Decoding over a static KV cache, its step compiled once (`rl.rollout_cache: static`).

`generation._decoded` decodes with transformers' DynamicCache: every step appends each layer's new keys and values
with `torch.cat` (a fifth of a CPU rollout's time), and its shapes change with every token, so the step runs
eagerly: a few hundred small kernels launched one by one from Python, which on a GPU is most of a small model's
decode step. Here the cache is transformers' StaticCache, allocated once for the rollout's longest row and written
in place, so every step has the same shapes: the step is compiled once (one graph, static shapes) and on a GPU
captured as a CUDA graph (torch.compile's reduce-overhead mode), then replayed per token.

Rows that end leave by halves. A CUDA graph is recorded for one batch size, so rather than a new shape each time a
row ends, the live rows move to the front of the cache whenever they fit in half of it, and the step runs on
that half: the first rows of the same tensors (views: nothing allocated), at most `MAX_HALVINGS` + 1 shapes, each
compiled once. Everything (the cache, its halves, their compiled steps) is kept for the next rollout of the same
shape (rows, and length rounded up to `LENGTH_STEP`): compiling per rollout would cost more than it saves.

The step computes the logits the dynamic path computes (to float rounding: a row attends over the whole cache
length, masked, so its sums run in another order), so the tokens are the same (tests/test_grpo.py,
tests/test_generation.py) and every guarantee of the rollouts (the same completions on 1 and N processes, exact
resume) holds unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PretrainedConfig, StaticCache
from transformers.cache_utils import StaticLayer

from finetune.errors import FinetuneError

LENGTH_STEP = 256
"""Cache lengths are rounded up to a multiple of this: rollouts whose prompts differ a little share a cache."""
MAX_HALVINGS = 6
"""Row counts a rollout's cache is halved to at most (each one compiled step): 64 rows down to 1."""

Pick = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(logits (rows, vocab), the rows' numbers (rows,), the new token's index) -> the rows' tokens (rows, 1)."""


def cache_length(tokens: int, positions: int | None = None) -> int:
    """The length of the static cache that holds rows of `tokens` (prompt and new tokens): rounded up to
    `LENGTH_STEP`, but never past the `positions` the model was built for (GPT-2's 1,024 learned ones; a small
    model's 64) where the rows fit in them: no slot the model could not attend to."""
    length = math.ceil(tokens / LENGTH_STEP) * LENGTH_STEP
    return min(length, positions) if positions is not None and tokens <= positions else length


def check_static_cache(config: PretrainedConfig, name: str) -> None:
    """`rl.rollout_cache: static`, refused before anything loads for a model whose cache it cannot hold."""
    if not _plain_static_cache(config):
        raise FinetuneError(
            f"rl.rollout_cache=static: {name!r} has layers whose cache is not a plain one (sliding windows, "
            "state-space layers), which the static cache's decoding does not hold; set rl.rollout_cache: dynamic"
        )


def _plain_static_cache(config: PretrainedConfig) -> bool:
    """Whether every layer of the model's StaticCache is a plain one (a sliding window's layer rolls its slots,
    and a state-space layer has none)."""
    try:
        cache = StaticCache(config=config, max_cache_len=LENGTH_STEP)
    except (ValueError, TypeError, AttributeError):
        return False
    return all(type(layer) is StaticLayer for layer in cache.layers)


@dataclass
class _Shape:
    """The caches of one rollout shape: the whole one and its halves (views of its first rows), their steps."""

    rows: int
    length: int
    attention: torch.Tensor  # (rows, length): the slots each row attends to
    caches: dict[int, StaticCache] = field(default_factory=dict)
    steps: dict[int, Callable] = field(default_factory=dict)


class StaticDecoding:
    """The decoding loop over static caches; one object per model, kept for the run. `compile`: torch.compile's
    settings for the step (`{"mode": "reduce-overhead"}` on a GPU: CUDA graphs), or None for an eager step."""

    def __init__(self, compile: dict[str, str] | None, say: Callable[[str], None] = print):
        self.compile, self.say = compile, say
        self._shape: _Shape | None = None

    def decode(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        prefix: DynamicCache | None,
        stops: list[int],
        max_new_tokens: int,
        pick: Pick,
        synced: bool,
    ) -> list[list[int]]:
        """Each left-padded row's new tokens, as `generation._decoded` writes them. `prefix`: the cache of every
        prompt column but the last (computed once per group of equal prompts); None for one-column prompts.
        `synced`: the processes run the same number of forwards (FSDP gathers parameters at each)."""
        rows, width = input_ids.shape
        device = input_ids.device
        positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        shape = self._shape_for(model, rows, cache_length(width + max_new_tokens, positions))
        seen = 0 if prefix is None else width - 1
        whole = shape.caches[rows]
        if prefix is not None:
            if not whole.layers[0].is_initialized:
                _allocate(whole, model, rows, prefix.layers[0].keys.dtype, device)
            for layer, source in zip(whole.layers, prefix.layers, strict=True):
                layer.keys[:, :, :seen] = source.keys
                layer.values[:, :, :seen] = source.values
        for layer in whole.layers:
            if layer.is_initialized:  # else its first forward allocates it, empty
                layer.cumulative_length.fill_(seen)
        shape.attention.zero_()
        shape.attention[:, :width] = mask
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        # Contiguous, as the later steps' tokens are: a compiled step is specialized to its inputs' strides.
        step_ids, step_positions = input_ids[:, seen:].contiguous(), positions[:, seen:].contiguous()
        size = rows  # the cache rows the step runs on: the whole cache, or its first half, quarter...
        live = torch.arange(rows)  # each of those rows' number; -1 for a row decoded only to fill a half
        writing = torch.ones(rows, dtype=torch.bool)  # by number: not ended yet
        stop_ids = torch.tensor(stops, device=device)
        out: list[list[int]] = [[] for _ in range(rows)]
        for t in range(max_new_tokens):
            logits = self._forward(model, shape, size, step_ids, step_positions, compiled=not synced)
            token = pick(logits, live.clamp(min=0), t)
            ended = torch.isin(token[:, 0], stop_ids).cpu()
            for row, value in zip(live.tolist(), token[:, 0].tolist(), strict=True):
                if row >= 0 and writing[row]:
                    out[row].append(value)
            real = live >= 0
            writing[live[real & ended]] = False
            keep = real & writing[live.clamp(min=0)]
            remaining = int(keep.sum())
            if all_ended(remaining, synced, device):
                break
            if t + 1 == max_new_tokens:
                break
            smaller = _half_that_holds(rows, size, max(remaining, 1))
            if smaller < size:
                kept = keep.nonzero().squeeze(1)
                filler = kept.new_zeros(smaller - remaining)  # decoded beside the others, never recorded
                at = torch.cat([kept, filler]).to(device)
                _move_to_front(shape.caches[size], self._cache(model, shape, smaller), at)
                shape.attention[:smaller] = shape.attention[at]
                live = torch.cat([live[kept], torch.full_like(filler, -1)])
                token, step_positions, size = token[at], step_positions[at], smaller
            step_ids = token
            step_positions = step_positions[:, -1:] + 1
            shape.attention[:size, width + t] = 1
        return out

    def _shape_for(self, model: torch.nn.Module, rows: int, length: int) -> _Shape:
        if self._shape is None or (self._shape.rows, self._shape.length) != (rows, length):
            # The previous shape's caches and steps are released.
            attention = torch.zeros(rows, length, dtype=torch.long, device=_device(model))
            self._shape = _Shape(
                rows, length, attention, {rows: StaticCache(config=model.config, max_cache_len=length)}
            )
        return self._shape

    def _cache(self, model: torch.nn.Module, shape: _Shape, size: int) -> StaticCache:
        """The cache of the first `size` rows: views of the whole cache's tensors."""
        if size not in shape.caches:
            cache = StaticCache(config=model.config, max_cache_len=shape.length)
            _view_rows(cache, shape.caches[shape.rows], size)
            shape.caches[size] = cache
        return shape.caches[size]

    def _forward(
        self,
        model: torch.nn.Module,
        shape: _Shape,
        size: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
        compiled: bool,
    ) -> torch.Tensor:
        """The logits of the step's last column; eager where not `compiled` (forwards that gather parameters: a
        graph would hold the collectives), and for the first forward of a shape without a prefix, which allocates
        the cache (in the dtype its keys come in)."""
        cache = shape.caches[size]
        if self.compile is None or not compiled or not cache.layers[0].is_initialized:
            return _step(model, cache, ids, positions, shape.attention[:size])
        if size not in shape.steps:
            step = functools.partial(_step, model, cache)
            shape.steps[size] = torch.compile(step, fullgraph=True, dynamic=False, **self.compile)
        torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: its graph may overwrite them
        try:
            # A compiled step per half of each shape met: more than dynamo's default of 8 graphs per function.
            with torch._dynamo.config.patch(recompile_limit=64):
                return shape.steps[size](ids, positions, shape.attention[:size])
        except torch._dynamo.exc.TorchDynamoException as exc:
            # A model whose forward dynamo cannot take whole (a quantized base's kernels, say): the static cache
            # still decodes, eagerly, and the log says why.
            self.compile = None
            reason = str(exc).strip().splitlines()[0][:200]
            self.say(f"warning: rl.rollout_cache=static: the decoding step could not be compiled ({reason}); it runs "
                     "eagerly")  # fmt: skip
            return _step(model, cache, ids, positions, shape.attention[:size])


def all_ended(remaining: int, synced: bool, device: torch.device) -> bool:
    """Whether a decoding loop stops: none of this process's rows is still writing (`remaining`), or, in lock-step
    (`synced`: every forward gathers parameters from every process), none of any process's (one all-reduce a
    step); until then a process whose rows have all ended decodes one more, unrecorded, for the others' sake."""
    if not synced:
        return remaining == 0
    everywhere = torch.tensor([remaining], device=device)
    torch.distributed.all_reduce(everywhere)
    return int(everywhere) == 0


def _step(
    model: torch.nn.Module, cache: StaticCache, ids: torch.Tensor, positions: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    return model(
        input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1, :]  # fmt: skip


def _half_that_holds(rows: int, size: int, remaining: int) -> int:
    """The smallest of the cache's halvings (rows, rows/2, ... at most MAX_HALVINGS times) that holds
    `remaining` rows; `size` where none is smaller."""
    best = size
    for halvings in range(1, MAX_HALVINGS + 1):
        candidate = math.ceil(rows / 2**halvings)
        if candidate < remaining:
            break
        best = min(best, candidate)
    return best


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _allocate(cache: StaticCache, model: torch.nn.Module, rows: int, dtype: torch.dtype, device) -> None:
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # A config without grouped key and value heads (GPT-2's) has as many as query heads.
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    cache.early_initialization(rows, heads, head_dim, dtype, device)


def _view_rows(cache: StaticCache, whole: StaticCache, rows: int) -> None:
    """`cache`'s layers made views of `whole`'s first `rows` rows, marked as fixed addresses (as StaticCache marks
    its own tensors) so that a CUDA graph reads and writes them in place. Reaches into StaticLayer's attributes
    (transformers ~=5.23, pinned): it has no constructor for a view."""
    for mine, theirs in zip(cache.layers, whole.layers, strict=True):
        mine.dtype, mine.device = theirs.dtype, theirs.device
        mine.batch_size, mine.num_heads = rows, theirs.num_heads
        mine.k_head_dim, mine.v_head_dim = theirs.k_head_dim, theirs.v_head_dim
        mine.keys, mine.values = theirs.keys[:rows], theirs.values[:rows]
        mine.cumulative_length = theirs.cumulative_length.clone()
        for tensor in (mine.keys, mine.values, mine.cumulative_length):
            torch._dynamo.mark_static_address(tensor)
        mine.is_initialized = True


def _move_to_front(source: StaticCache, target: StaticCache, rows: torch.Tensor) -> None:
    """The `rows` of `source` copied to `target` (the first rows of the same tensors), and its fill level."""
    for into, layer in zip(target.layers, source.layers, strict=True):
        into.keys.copy_(layer.keys[rows])
        into.values.copy_(layer.values[rows])
        into.cumulative_length.copy_(layer.cumulative_length)
