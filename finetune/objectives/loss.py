"""The training loss: next-token cross-entropy, summed over the target tokens of a batch.

Two paths, chosen by `train.loss_path`:

- `full_logits` (the reference): the model returns logits for every position, they are upcast to
  fp32 and `F.cross_entropy` takes them. For a 128,256-token vocabulary that is 1 GiB per 2,048
  tokens, kept for backward, plus the softmax's transients.
- `chunked` (the default): the output projection keeps only the positions that have a target (their
  indices come with the batch, `kept_index`), and it runs with the cross-entropy inside one autograd
  function, a chunk of rows at a time, so a chunk's logits exist only while its loss and gradients are
  computed. The gradients are computed in the forward: the loss is a sum, so backward only scales them
  by one number. That costs the same three matmuls as the reference, and nothing of the logits' size is
  kept for backward.

The projection must run inside the model's own forward: under FSDP the head's parameters are
gathered by the forward hooks of its unit (or of the root), which fire only around that call. So
the head's `forward` is swapped for the duration of one call of the model (`_head_computes_loss`),
and the summed loss leaves the model as its output, where FSDP hooks its backward.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from finetune.engine import attention, shared_attention
from finetune.engine.batch import IGNORE, Batch, kept_positions

LossPath = Literal["chunked", "full_logits"]
MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")

# Architectures whose causal-LM forward is `lm_head(slice_logits_to_keep(hidden))` and nothing after it
# (no logit soft-capping or scaling), so that a head computing the loss sees what the logits would be.
CHUNKED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "gpt2",
        "gemma",
        "olmo2",
        "olmoe",
        "gpt_oss",
    }
)
_CHUNK_BYTES = {"cpu": 64 * 2**20, "cuda": 2**30}
"""Bytes of fp32 logits per chunk, by device type. Each chunk adds its share into the head's weight gradient,
reading and writing all of it: with chunks of a few hundred rows that traffic, not the matmuls, set the
GPU's pace (measured on an H100: 0.78x the full logits' tokens/s at 64 MiB chunks). A GiB of logits is a
few percent of a GPU's memory and keeps the head's matmuls compute-bound; on CPU the step is compute-bound
at any size, and small chunks keep the host's memory low."""


@dataclass(frozen=True)
class BatchLoss:
    total: torch.Tensor
    """Sum of the token losses; differentiable when gradients are enabled."""
    per_row: torch.Tensor
    """Sum of each row's token losses, detached, shape (rows,)."""


def batch_loss(model: torch.nn.Module, batch: Batch, path: LossPath) -> BatchLoss:
    """The summed next-token loss of a batch of `input_ids` / `target_ids` rows (IGNORE where none)."""
    inputs = model_inputs(model, batch)
    targets = batch["target_ids"]
    if path == "full_logits":
        logits = model(**inputs, use_cache=False).logits  # a KV cache only costs memory here
        # Upcast so that a bf16 forward does not also give a bf16 loss.
        losses = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
        )
        losses = losses.view_as(targets)
        return BatchLoss(losses.sum(), losses.detach().sum(dim=1))
    kept = target_positions(batch)
    with _head_computes_loss(output_head(model), kept, targets.reshape(-1).index_select(0, kept)) as per_token:
        # The loss comes out as the model's output (`logits`, one value): FSDP hooks its backward on outputs.
        total = model(**inputs, use_cache=False, logits_to_keep=0).logits.reshape(())
    rows = kept.div(targets.shape[1], rounding_mode="floor")
    per_row = torch.zeros(targets.shape[0], device=targets.device).index_add_(0, rows, per_token[0])
    return BatchLoss(total, per_row)


def target_positions(batch: Batch) -> torch.Tensor:
    """The positions with a target, as indices into the batch's rows flattened (rows made one for the varlen and
    flash paths keep that order). The collators computed them on the host (`kept_index`): found here, on a
    GPU, they would stall the host until the device caught up (`nonzero` must know how many there are)."""
    kept = batch.get("kept_index")
    return kept if kept is not None else kept_positions(batch["target_ids"])


def model_inputs(model: torch.nn.Module, batch: Batch) -> dict[str, Any]:
    """What the model is given of a batch. Packed rows (samples told apart by `position_ids` restarting,
    no attention mask) become one row for the kernels that take sample boundaries: the varlen path gets
    them as `cu_seq_lens` (finetune.engine.attention), and transformers' flash-attention derives them from
    `position_ids` only when the batch has one row; with more it would let every row attend across its
    samples without a word. The rows' boundaries are restarts too, so one row of all of them attends
    exactly as the rows did; the loss reads the outputs in the same order."""
    inputs: dict[str, Any] = {key: value for key, value in batch.items() if key in MODEL_INPUTS}
    implementation = _attention_implementation(model)
    if "shared_prompt" in batch:  # a prompt shared by its completions (finetune.data.rollout)
        if implementation != shared_attention.NAME:  # its grouping would be ignored: refuse
            raise RuntimeError(f"shared rows need the {shared_attention.NAME!r} attention, not {implementation!r}")
        return inputs | {"shared_prompt": batch["shared_prompt"]}
    packed = "position_ids" in inputs and "attention_mask" not in inputs
    if packed and implementation == attention.NAME:
        boundaries = attention.boundaries(inputs["position_ids"], batch.get("cu_seq_lens"))
        if not attention.rows_split():  # split rows are whole, and flattened, only inside attention
            inputs = {key: value.reshape(1, -1) for key, value in inputs.items()}
        inputs |= boundaries
    elif packed and inputs["input_ids"].shape[0] > 1 and _flash_attention(implementation):
        inputs = {key: value.reshape(1, -1) for key, value in inputs.items()}
    return inputs


def _attention_implementation(model: torch.nn.Module) -> str | None:
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None)


def _flash_attention(implementation: str | None) -> bool:
    from transformers.utils.generic import is_flash_attention_requested

    requested = implementation is not None
    return requested and is_flash_attention_requested(requested_attention_implementation=implementation)


def choose_loss_path(requested: LossPath, model: torch.nn.Module) -> tuple[LossPath, str]:
    """The loss path this model runs (`train.loss_path`, unless the model cannot take the chunked one), and its log
    line."""
    if requested == "full_logits":
        return "full_logits", "loss: full logits in fp32 (train.loss_path=full_logits)"
    reason = chunked_loss_unsupported(model)
    if reason is not None:
        return "full_logits", f"loss: full logits in fp32, as chunked cannot run here: {reason}"
    head = output_head(model)
    vocab = head.out_features  # the weight itself may be a flat shard here (FSDP1)
    rows = chunk_rows(vocab, head.weight.device)
    return "chunked", (
        f"loss: chunked (logits at target positions only, {rows} rows of {vocab:,} at a time; "
        "train.loss_path=full_logits for the reference)"
    )


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's output projection (through DDP, PEFT and compile wrappers)."""
    inner = getattr(model, "module", model)
    return inner.get_output_embeddings()


def chunked_loss_unsupported(model: torch.nn.Module) -> str | None:
    """Why the chunked loss cannot run on this model (the run then takes `full_logits`), or None."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in CHUNKED_MODEL_TYPES:
        return f"model type {model_type} is not one whose output layer is known to be a plain projection"
    head = output_head(model)
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return f"its output layer is adapted or quantized ({type(head).__module__}.{type(head).__name__})"
    base = getattr(inner, "get_base_model", lambda: inner)()
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return f"{type(base).__name__}.forward takes no logits_to_keep"
    return None


@contextlib.contextmanager
def _head_computes_loss(
    head: torch.nn.Linear, kept: torch.Tensor, targets: torch.Tensor
) -> Iterator[list[torch.Tensor]]:
    """While inside: the head, called by the model's forward on every position's hidden state, returns the
    summed loss of the `kept` positions against their `targets` as a one-element tensor instead of logits;
    the list yielded receives the per-token losses."""
    per_token: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)
        with_grads = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
        total, losses = _LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, with_grads)
        per_token.append(losses)
        # A new tensor, not a view of `total`: FSDP2 warns about views leaving a unit (an in-place op on
        # one would skip its backward hook).
        return torch.stack([total])

    with head_forward(head, forward):
        yield per_token


@contextlib.contextmanager
def head_forward(head: torch.nn.Linear, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While inside, the head's forward is `forward` (inside the model's own forward, where FSDP has gathered
    the head's parameters); afterwards the class's forward again."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    return max(1, _CHUNK_BYTES.get(device.type, _CHUNK_BYTES["cuda"]) // (4 * vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T + bias, target_i) over rows whose target is not IGNORE, a chunk of rows
    at a time; returns (sum, per-row losses). With gradients asked for, each chunk's gradients with respect
    to hidden, weight and bias are computed while its logits exist; backward scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        with_grads: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = chunk_rows(weight.shape[0], weight.device)  # inside the forward: the whole weight
        losses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if with_grads and ctx.needs_input_grad[0] else None
        # In the weight's dtype, as Liger's kernel keeps it: one buffer the size of the head's gradient, which
        # the reference allocates too (a bf16 weight then rounds once per chunk instead of once).
        grad_weight = torch.zeros_like(weight) if with_grads and ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if with_grads and ctx.needs_input_grad[2] else None
        # The dtype the reference's backward multiplies in: under autocast (float32 weights, no FSDP) its
        # logits, and so their gradient, are in the autocast dtype. An in-place addmm_ is not autocast: left in
        # float32 it ran as a SIMT SGEMM, 14% of an H200's step on the 1B shape.
        device = hidden.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        weight_in_compute = weight.to(compute)  # once, not once per chunk (no copy when the dtypes agree)
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start : start + rows], targets[start : start + rows]
            valid = t != IGNORE
            safe = torch.where(valid, t, 0).unsqueeze(1)
            # One fused pass over the chunk's logits for log-softmax (logsumexp is a composite of several
            # full-size passes), reading bf16 logits as fp32 inside the kernel; then the gradient in place.
            log_probs = torch.log_softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32)
            losses[start : start + rows] = torch.where(valid, -log_probs.gather(1, safe).squeeze(1), 0.0)
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            # d loss / d logits = softmax - one-hot of the target, zero for rows without a target; the zeroing
            # is applied to the small operands (h, the row weights), not to a pass over the logits.
            grad_logits = log_probs.exp_()
            grad_logits.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad_logits.dtype))
            if grad_bias is not None:
                grad_bias.addmv_(grad_logits.t(), valid.to(grad_logits.dtype))
            grad_logits = grad_logits.to(compute)  # as the reference's backward through `.float()`
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = (grad_logits @ weight_in_compute) * valid.unsqueeze(1)
            if grad_weight is None:
                continue
            kept = (h * valid.unsqueeze(1)).to(compute)
            if compute == weight.dtype:
                grad_weight.addmm_(grad_logits.t(), kept)
            else:  # the product in the compute dtype, summed over chunks in the weight's
                grad_weight += grad_logits.t() @ kept
        ctx.mark_non_differentiable(losses)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return losses.sum(), losses

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = [
            (grad * grad_total).to(dtype) if needed else None
            for grad, dtype, needed in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3], strict=True)
        ]
        return (*grads, None, None)


def sequence_logps(model: torch.nn.Module, batch: Batch, path: LossPath) -> torch.Tensor:
    """The log-probability of each sequence's target tokens, summed: shape (sequences,), differentiable when
    gradients are enabled. A batch's rows hold the sequences (packed or padded); `sequence_ids` names the
    sequence of every position with a target (-1 elsewhere), `sequence_targets` counts each one's targets."""
    per_token = token_logps(model, batch, path)
    sequences = batch["sequence_targets"].shape[0]
    zeros = torch.zeros(sequences, dtype=torch.float32, device=per_token.device)
    return zeros.index_add(0, batch["sequence_ids"].reshape(-1).index_select(0, target_positions(batch)), per_token)


def token_logps(model: torch.nn.Module, batch: Batch, path: LossPath, temperature: float = 1.0) -> torch.Tensor:
    """The log-probability of every target token, in fp32, in the order of the positions with a target (rows
    flattened): log softmax(logits / temperature)[target]. Differentiable when gradients are enabled.
    The chunked path never holds the logits whole, as `batch_loss`; as the gradient of each token's
    log-probability is weighted by what it feeds (a preference or policy loss is not a sum of token losses),
    its backward recomputes a chunk's logits instead of keeping gradients from the forward."""
    inputs = model_inputs(model, batch)
    kept = target_positions(batch)
    kept_targets = batch.get("kept_targets")  # a position may predict several tokens (online RL's shared rows)
    if kept_targets is None:
        kept_targets = batch["target_ids"].reshape(-1).index_select(0, kept)
    if path == "full_logits":
        logits = model(**inputs, use_cache=False).logits
        kept_logits = logits.flatten(0, 1).index_select(0, kept).float() / temperature
        return -F.cross_entropy(kept_logits, kept_targets, reduction="none")
    head = output_head(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)
        bias = head.bias
        if temperature != 1.0:  # (h W + b) / T, without a logits-sized tensor
            hidden, bias = hidden / temperature, bias / temperature if bias is not None else None
        return _LinearLogProbs.apply(hidden, head.weight, bias, kept_targets)

    with head_forward(head, forward):
        return model(**inputs, use_cache=False, logits_to_keep=0).logits.reshape(-1).float()


class _LinearLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T + bias)[target] for each row, a chunk of rows at a time; backward
    recomputes each chunk's logits and weights its gradient by the incoming gradient of each row."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
    ) -> torch.Tensor:
        rows = chunk_rows(weight.shape[0], weight.device)
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start : start + rows], targets[start : start + rows]
            log_probs = torch.log_softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32)
            logps[start : start + rows] = log_probs.gather(1, t.unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets)
        ctx.has_bias = bias is not None
        return logps

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        needs = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        rows = chunk_rows(weight.shape[0], weight.device)
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start : start + rows], targets[start : start + rows].unsqueeze(1)
            g = grad[start : start + rows].float().unsqueeze(1)
            # d log p[t] / d logits = one-hot(t) - softmax(logits), scaled by each row's incoming gradient.
            grad_logits = torch.softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32).mul_(-g)
            grad_logits.scatter_add_(1, t, g)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t().float(), h.float())
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
        )
