"""Evaluation by generation (`eval.generate`): held-out prompts answered by the model as it trains, scored.

The prompts are the eval split's: a conversation up to its last assistant turn, rendered with the chat template's
generation prompt (the reference: that turn's text), or a prompt/completion sample's prompt (the reference: its
completion); `eval.generate.column` names another column as the reference. Greedy decoding with a KV cache, up to
`max_new_tokens`; the completion is decoded without special tokens and stripped, then scored: `exact_match` (equal
to the reference, stripped) or `contains` (the reference appears in it).

Under FSDP every forward gathers parameters from every process, so the processes decode in lock-step: a process
whose completions have all ended keeps running forwards (their outputs discarded) until every process's have.
Where nothing is gathered after the first forward (DDP, one process, or every unit's parameters kept gathered:
`generating(model, gather_once=True)`), each process stops when its own completions have ended. Each process
answers its share of the prompts (equal shares: the last prompt repeats where they do not divide, and is scored
once); the scores are summed over processes, so a run reports the same numbers on any process count.
Generation attends through SDPA with the padding mask (prompts are left-padded), whatever the training
attention: the varlen path knows whole packed rows, not a growing cache; under sequence parallelism each process
generates on whole rows of its own.

`complete` is the engine, for evaluation and for online RL's rollouts (`finetune.objectives.grpo`): token ids in,
completion ids out, greedy or sampled with seeded noise, by a decoding loop of our own (`_decoded`: the rows that
have ended leave the batch and its cache) or, as the reference and for models with caches of their own kind,
transformers' `generate`. It is the seam where a colocated inference engine
(vLLM) would take transformers' place on GPUs: it would need the trained weights pushed to it after every update
(one gathered copy of them, by layer), the same stop tokens and sampling settings, and the uniform noise per
row below (or log-probabilities returned with its samples, for the importance ratio).

Seeded sampling: each row brings its own uniform numbers, one per new token, drawn from a generator seeded by
what the row is (the run's seed, the rollout, the prompt's index in the data, the completion's number), never by
which process draws it or what else is in its batch. A token is the first whose cumulative probability (after
temperature and top-p) reaches the row's number for that position: inverse-transform sampling, the same
completions on any process count and on resume.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy
import torch
from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerBase
from transformers.generation.logits_process import TopPLogitsWarper

from finetune.config import GenerateConfig
from finetune.data.prompts import Prompt
from finetune.engine import attention, shared_attention
from finetune.engine.processes import equal_share
from finetune.engine.wrap import reshard
from finetune.errors import FinetuneError
from finetune.rollouts.static_decode import Pick, StaticDecoding, all_ended

BATCH = 16
"""Prompts decoded together on a process."""


@dataclass
class GenerationEval:
    """`eval.generate` for a run: its prompts, and how completions are scored."""

    cfg: GenerateConfig
    prompts: list[Prompt]
    tokenizer: PreTrainedTokenizerBase

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, accelerator: Accelerator) -> dict[str, float]:
        """The share of prompts whose completion scores, and the completions' mean length in tokens (a
        collective: every process calls it)."""
        mine, real = equal_share(len(self.prompts), accelerator.num_processes, accelerator.process_index)
        scored = torch.zeros(3, dtype=torch.float64)  # correct, completion tokens, prompts scored
        model.eval()
        with generating(model) as lock_step:
            for start in range(0, len(mine), BATCH):
                batch = mine[start : start + BATCH]
                completions, lengths = self._complete(model, [self.prompts[i] for i in batch], accelerator, lock_step)
                for n, (i, completion, length) in enumerate(zip(batch, completions, lengths, strict=True)):
                    if start + n < real:
                        scored += torch.tensor([self._score(completion, self.prompts[i].reference), length, 1.0])
        reshard(model)
        model.train()
        correct, tokens, count = accelerator.reduce(scored.to(accelerator.device), "sum").tolist()
        return {self.cfg.metric: correct / max(count, 1), "completion_tokens": tokens / max(count, 1)}

    def _complete(
        self, model: torch.nn.Module, prompts: list[Prompt], accelerator: Accelerator, lock_step: bool
    ) -> tuple[list[str], list[int]]:
        completions = complete(
            model, [p.ids for p in prompts], self.tokenizer, accelerator, self.cfg.max_new_tokens, lock_step=lock_step
        )
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in completions]
        return texts, [len(ids) for ids in completions]

    def _score(self, completion: str, reference: str) -> float:
        if self.cfg.metric == "contains":
            return float(reference.strip() in completion)
        return float(completion == reference.strip())

    def describe(self, step: int, values: dict[str, float]) -> str:
        """The log line of one evaluation."""
        share = values[self.cfg.metric]
        count = len(self.prompts)
        return (
            f"step {step}: {self.cfg.metric.replace('_', ' ')} {round(share * count)}/{count} ({100 * share:.1f}%) "
            f"by generation, {values['completion_tokens']:.1f} tokens a completion"
        )


def stop_tokens(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Where a completion ends: the tokenizer's end of sequence and the model's generation config's (a chat model's
    end-of-turn token, where the two differ)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    configured = getattr(getattr(inner, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(t for t in [tokenizer.eos_token_id, *configured] if t is not None))


@dataclass(frozen=True)
class Sampling:
    """How a completion's tokens are drawn (online RL); None where `complete` is asked for greedy decoding."""

    temperature: float
    top_p: float
    noise: torch.Tensor
    """(rows, max_new_tokens) uniform numbers in [0, 1), one per row and new token (`row_noise`)."""


def row_noise(seeds: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    """Each row's uniform numbers, from a generator seeded by the row's identity (a few integers)."""
    return torch.from_numpy(numpy.stack([numpy.random.default_rng(list(seed)).random(length) for seed in seeds]))


def drawn(
    scores: torch.Tensor, noise: torch.Tensor, sampling: Sampling, top_p: TopPLogitsWarper | None
) -> torch.Tensor:
    """(rows, 1) each row's next token: the first whose cumulative probability (after temperature and top-p)
    reaches the row's uniform number `noise` (rows, 1)."""
    scores = scores.float() / sampling.temperature
    if top_p is not None:
        scores = top_p(None, scores)
    cumulative = torch.softmax(scores, dim=-1).cumsum(dim=-1)
    # Scaled by the total, which rounding leaves a hair from 1; clamped for the same reason.
    drawn = noise.to(scores.device, torch.float32)
    return torch.searchsorted(cumulative, drawn * cumulative[:, -1:]).clamp(max=scores.shape[-1] - 1)


class _InverseTransform(LogitsProcessor):
    """Sampling as a logits processor: each row's next token chosen from its own noise (see the module's
    docstring), every other token masked, so that transformers' greedy step picks it."""

    def __init__(self, sampling: Sampling, prompt_width: int):
        self.sampling, self.prompt_width = sampling, prompt_width
        self.top_p = TopPLogitsWarper(sampling.top_p) if sampling.top_p < 1 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        position = input_ids.shape[1] - self.prompt_width
        token = drawn(scores, self.sampling.noise[:, position : position + 1], self.sampling, self.top_p)
        return torch.full_like(scores, -torch.inf).scatter_(1, token, 0.0)


def complete(
    model: torch.nn.Module,
    prompts: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
    accelerator: Accelerator,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    lock_step: bool = True,
    group: int = 1,
    reference: bool = False,
    static: StaticDecoding | None = None,
) -> list[list[int]]:
    """Each prompt's completion token ids, up to and including the token that ended it (or `max_new_tokens` of
    them), greedy or sampled. Every process calls it together, inside `generating(model)`, whose value says
    whether the processes must decode in `lock_step` (their forwards gather parameters). `group`: each prompt
    comes that many times in a row (online RL's completions of a prompt), and its forward runs once. The model
    decodes in a loop of our own where it can (`decodes_itself`), else, or with `reference`, in transformers'
    `generate`: the same tokens (tests/test_generation.py). `static`: the loop over a static cache whose step is
    compiled (finetune.rollouts.static_decode), for models whose cache it can hold; the same tokens again."""
    pad = tokenizer.pad_token_id
    input_ids, mask = left_padded(prompts, pad, accelerator.device)
    width = input_ids.shape[1]
    # Settings of our own, not the model's generation config (a chat model's sampling defaults, a repetition
    # penalty): online RL trains the log-probabilities of the distribution it sampled from.
    stops = stop_tokens(model, tokenizer)
    # DDP's wrapper has no `generate`; its module computes alike without gradients (nothing to synchronize).
    generator = model.module if isinstance(model, DistributedDataParallel) else model
    synced = lock_step and accelerator.num_processes > 1
    if static is not None and not reference:  # a model it can decode (`rollout_decoding` checked)
        # An adapter model's forward only hands its arguments to its base model (adapters inside): the base's is
        # the forward compiled, without the wrapper's context managers.
        base = _without_adapter_wrapper(generator)
        prefix = shared_prompts_cache(base, input_ids, mask, group, shared_only=False)
        rows = static.decode(base, input_ids, mask, prefix, stops, max_new_tokens, picker(sampling), synced)
    elif decodes_itself(generator) and not reference:
        rows = _decoded(generator, input_ids, mask, stops, max_new_tokens, sampling, synced, group)
    else:
        processors = LogitsProcessorList([_InverseTransform(sampling, width)] if sampling is not None else [])
        settings = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=pad, use_cache=True
        )
        cache = shared_prompts_cache(generator, input_ids, mask, group)
        output = generator.generate(
            input_ids=input_ids, attention_mask=mask, generation_config=settings, logits_processor=processors,
            synced_gpus=synced, **({"past_key_values": cache} if cache else {}),
        )  # fmt: skip
        rows = output[:, width:].tolist()
    completions = []
    for row in rows:
        end = next((n + 1 for n, token in enumerate(row) if token in stops), len(row))
        completions.append(row[:end])
    return completions


def sample_rollout(
    model: torch.nn.Module,
    prompts: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
    accelerator: Accelerator,
    max_new_tokens: int,
    sampling: Sampling,
    gather_once: bool,
    group: int = 1,
    static: StaticDecoding | None = None,
) -> list[list[int]]:
    """The prompts' completions sampled as a training objective's rollout takes them (online RL's, on-policy
    distillation's; a collective): the model in eval mode, without gradients, inside `generating` (parameters
    gathered once, or decoding in lock-step), its training mode restored after."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), generating(model, gather_once=gather_once) as lock_step:
        completions = complete(
            model, prompts, tokenizer, accelerator, max_new_tokens, sampling, lock_step, group, static=static
        )
    model.train(was_training)
    return completions


def cut_short(completions: list[list[int]], stops: list[int]) -> list[bool]:
    """Whether each completion was cut at a length limit: it does not end with one of the `stops`."""
    return [not c or c[-1] not in stops for c in completions]


def decodes_itself(model: torch.nn.Module) -> bool:
    """Whether `complete` decodes `model` with its own loop (a KV cache of transformers' default kind, and a
    forward that computes only the logits asked for); else with transformers' `generate`. An adapter model's
    forward hands its keyword arguments to its base model's: the base's forward is the one asked."""
    base = _without_adapter_wrapper(model)
    supported = getattr(base, "_supports_default_dynamic_cache", None)
    return callable(supported) and supported() and "logits_to_keep" in inspect.signature(base.forward).parameters


def _without_adapter_wrapper(model: torch.nn.Module) -> torch.nn.Module:
    """An adapter model's base model (its adapters inside), whose forward the wrapper's hands its arguments to;
    any other model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoded(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    stops: list[int],
    max_new_tokens: int,
    sampling: Sampling | None,
    synced: bool,
    group: int,
) -> list[list[int]]:
    """Each left-padded row's new tokens, decoded as `generate` decodes them (the same logits, the same picks)
    without its per-token machinery, and with the rows that have ended leaving the batch and the cache: later
    steps compute only the rows still writing. `synced` (FSDP gathering per layer at every forward): the processes
    run the same number of forwards, a process whose rows have all ended decoding one of them, unrecorded."""
    rows = input_ids.shape[0]
    device = input_ids.device
    cache = shared_prompts_cache(model, input_ids, mask, group) or DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    seen = cache.get_seq_length()  # the prompts' shared part, already in the cache
    step_ids, step_positions, attention = input_ids[:, seen:], positions[:, seen:], mask
    live = torch.arange(rows)  # the batch's rows, by their number
    writing = torch.ones(rows, dtype=torch.bool)  # by number: not ended yet
    stop_ids = torch.tensor(stops, device=device)
    pick = picker(sampling)
    out: list[list[int]] = [[] for _ in range(rows)]
    for t in range(max_new_tokens):
        logits = model(
            input_ids=step_ids, attention_mask=attention, position_ids=step_positions, past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        ).logits[:, -1, :]  # fmt: skip
        token = pick(logits, live, t)
        ended = torch.isin(token[:, 0], stop_ids).cpu()
        for row, value in zip(live.tolist(), token[:, 0].tolist(), strict=True):
            if writing[row]:
                out[row].append(value)
        writing[live[ended]] = False
        keep = writing[live]
        remaining = int(keep.sum())
        if all_ended(remaining, synced, device):
            break
        if remaining == 0:
            keep[0] = True  # decoded for the other processes' sake only (synced)
        if t + 1 == max_new_tokens:
            break
        if not keep.all():
            kept = keep.nonzero().squeeze(1)
            cache.batch_select_indices(kept.to(device))
            live, token, attention = live[kept], token[kept.to(device)], attention[kept.to(device)]
            step_positions = step_positions[kept.to(device)]
        step_ids = token
        step_positions = step_positions[:, -1:] + 1
        attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
    return out


def picker(sampling: Sampling | None) -> Pick:
    """How a decoding loop picks each row's next token from its logits: the likeliest, or drawn with the row's
    noise for its position `t` (one for every row, or a tensor of each row's own: its place in an episode,
    `finetune.rollouts.episodes`), by `drawn`."""
    if sampling is None:
        return lambda logits, rows, t: logits.float().argmax(dim=-1, keepdim=True)
    top_p = TopPLogitsWarper(sampling.top_p) if sampling.top_p < 1 else None
    return lambda logits, rows, t: drawn(logits, sampling.noise[rows, t].unsqueeze(1), sampling, top_p)


def left_padded(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a decoding loop takes them: ids left-padded to the longest, and the mask of the real ones."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    return input_ids, mask


def shared_prompts_cache(
    model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, group: int, shared_only: bool = True
) -> DynamicCache | None:
    """The KV cache of the prompts but their last token, computed once per `group` of equal rows and repeated for
    each: `generate` then runs the last token onwards (it skips what the cache holds). Left padding ends every
    prompt in the last column, so the rows' caches line up. None where nothing is shared (`shared_only`; the
    static loop takes it whatever the group), or the model generates with a cache of its own kind (a
    state-space or hybrid model's)."""
    if (group < 2 and shared_only) or input_ids.shape[1] < 2 or not model._supports_default_dynamic_cache():
        return None
    cache = prefilled(model, input_ids[::group, :-1], mask[::group, :-1])
    cache.batch_repeat_interleave(group)
    return cache


def prefilled(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> DynamicCache:
    """The KV cache of left-padded rows (`mask`: 1 on real tokens), one forward."""
    # The positions generate gives left-padded rows: counted over the real tokens (padding's are never seen).
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
          logits_to_keep=1)  # fmt: skip
    return cache


@contextlib.contextmanager
def generating(model: torch.nn.Module, gather_once: bool = False) -> Iterator[bool]:
    """The model as generation needs it: SDPA with the padding mask, rows whole on every process; with
    `gather_once`, every FSDP unit's parameters gathered by the first decoding step (the prompts' forward, which
    every process runs) and kept until the end: one all-gather per unit instead of one per unit and token. Then
    back as it was, parameters resharded. Yields whether decoding must go in lock-step (later forwards gather)."""
    inner = getattr(model, "module", model)
    implementation = inner.config._attn_implementation
    split = attention.current_sequence_group()
    attention.split_rows_over(None)
    switched = implementation in (attention.NAME, shared_attention.NAME)  # training-only kernels
    if switched:
        inner.set_attn_implementation("sdpa")
    kept = _keep_gathered(model) if gather_once else None
    _gather_root(model)
    sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    try:
        yield sharded and not gather_once
    finally:
        if kept is not None:
            _restore_resharding(kept)
        reshard(model)
        if switched:
            inner.set_attn_implementation(implementation)
        attention.split_rows_over(split)


def _gather_root(model: torch.nn.Module) -> None:
    """The root FSDP unit's own parameters (embeddings, final norm, head) gathered for the whole generation: an
    adapter model's `generate` runs its base model's forward, below the root, whose hooks would gather them. The
    root is initialized first, as its forward would be (the first unit to run is taken for the root)."""
    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()
        model.unshard()


def _keep_gathered(model: torch.nn.Module) -> list[tuple[object, object, bool]]:
    """Every FSDP unit set to keep its parameters gathered after its forward; what it was set to, to restore.
    torch has a setter for this (`set_reshard_after_forward`) and no getter: the setting is read where the
    setter writes it."""
    was = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            was += [(group, group.post_forward_mesh_info, state) for group in state._fsdp_param_groups]
            auto = state._auto_reshard_after_forward
            module.set_reshard_after_forward(False, recurse=False)
            state._auto_reshard_after_forward = auto
    return was


def _restore_resharding(was: list[tuple[object, object, object]]) -> None:
    for group, mesh_info, state in was:
        # The root unit never reshards after forward unless told to (set at its lazy initialization, which may
        # have happened during this generation, after `was` was read).
        root = state._is_root and state._auto_reshard_after_forward
        group.post_forward_mesh_info = None if root else mesh_info


def gathers_once(model: torch.nn.Module, accelerator: Accelerator) -> tuple[bool, str]:
    """Whether generation gathers every layer's parameters once per rollout (when the whole model fits in half
    the device's free memory, beside the KV cache and the sharded state), or once per layer and token."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    unit = 2**30
    if accelerator.device.type != "cuda":
        return True, f"generation: parameters gathered once per rollout ({size / unit:.2f} GiB, in host memory)"
    free, _ = torch.cuda.mem_get_info(accelerator.device)
    if size <= free / 2:
        return (
            True,
            f"generation: parameters gathered once per rollout ({size / unit:.1f} GiB of {free / unit:.1f} free)",
        )
    return False, (
        f"generation: parameters gathered per layer at every token (the whole model, {size / unit:.1f} GiB, is more "
        f"than half the {free / unit:.1f} GiB free)"
    )


def rollout_decoding(
    setting: str, model: torch.nn.Module, accelerator: Accelerator
) -> tuple[StaticDecoding | None, str]:
    """`rl.rollout_cache`: the static cache's decoding (None: the dynamic loop), and the log line saying how the
    step runs. Its step is compiled, and replayed as a CUDA graph, on a GPU where no FSDP hook runs in the forward
    (one process or DDP): FSDP2's hooks stop torch.compile from taking the step whole (graph breaks), and a
    collective would be captured with it. On CPU the step stays eager: compiling it gained about 10% on the
    bench model at the cost of half a minute per shape. `model`: unwrapped (`accelerator.unwrap_model`)."""
    if setting == "dynamic":
        how = "rows leaving it as they end" if decodes_itself(model) else "decoded by transformers' generate"
        return None, f"rollouts: a dynamic KV cache, {how} (rl.rollout_cache=dynamic)"
    # Caches of another kind than the static one's plain layers were refused before loading (check_static_cache).
    if not decodes_itself(model):
        raise FinetuneError(
            f"rl.rollout_cache=static: {type(model).__name__}'s forward cannot compute the last position alone "
            "(no logits_to_keep), which the static cache's decoding step needs; set rl.rollout_cache: dynamic"
        )
    sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    if accelerator.device.type == "cuda" and not sharded:
        how = "the decoding step compiled and replayed as a CUDA graph"
        static = StaticDecoding({"mode": "reduce-overhead"}, accelerator.print)
        return static, f"rollouts: a static KV cache, {how} (rl.rollout_cache)"
    why = "FSDP's hooks run in every forward" if sharded else f"on {accelerator.device.type}, not a GPU"
    static = StaticDecoding(None, accelerator.print)
    return static, f"rollouts: a static KV cache, the decoding step eager ({why}; rl.rollout_cache)"
