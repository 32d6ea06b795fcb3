"""How far a student's next-token distribution is from a teacher's: distillation's loss (finetune.objectives.distill).

Per trained token, over the whole vocabulary, of both models' logits divided by a temperature T
(p = softmax(teacher / T), q = softmax(student / T)):

    forward_kl   KL(p || q)   the student covers every token the teacher would say (the data's view)
    reverse_kl   KL(q || p)   the student's own choices graded by the teacher (mode-seeking, on-policy's usual)
    jsd          beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q   (GKD's generalized JSD)

TRL's `GKDTrainer.generalized_jsd_loss` computes these for beta 0, 1 and in between (tests/test_distill.py holds
it as the oracle). A token's loss may add `ce_weight` x its cross-entropy (at temperature 1: the likelihood of
the token itself).

Two paths, as the supervised loss (`finetune.objectives.loss`): `full_logits` (the reference: both models' logits
whole, autograd through them) and `chunked`, where the student's head runs inside its own forward on the trained
positions only, a chunk of rows at a time, beside the same rows of the teacher's logits, so neither model's logits
ever exist whole. The teacher's part of a chunk comes from its last hidden states at the trained positions and a
copy of its output weight, taken inside its forward (where FSDP has gathered it). The chunk's gradients are taken
in the forward by autograd over that chunk's logits alone: the loss is a sum of token losses, so backward only
scales them.

The sampled estimator (`distill.estimator: sampled`, `sampled_reverse_kl`) replaces the vocabulary-wide reverse KL
on the student's own completions by its one-sample estimate at the token the student wrote, log q(x) - log p(x),
trained as a negative advantage with the policy-gradient loss: both models give the sampled tokens' log-probabilities
alone (`finetune.objectives.loss.token_logps`, a chunk of rows at a time on the chunked path).

A precomputed teacher (`distill.teacher_top_k`, `finetune.objectives.teacher_table`) gives its k most likely tokens
and their log-probabilities instead of logits: the divergence is then over those k tokens, both distributions
renormalized on them (the student's logits gathered at the teacher's ids), on either path.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from finetune.engine.batch import Batch
from finetune.objectives.loss import (
    LossPath,
    chunk_rows,
    head_forward,
    model_inputs,
    output_head,
    target_positions,
    token_logps,
)

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


@dataclass(frozen=True)
class Spec:
    """What a token's loss is: the divergence (with jsd's beta), the temperature, the cross-entropy's weight."""

    divergence: Divergence
    beta: float
    temperature: float
    ce_weight: float = 0.0


@dataclass(frozen=True)
class TopK:
    """A precomputed teacher's part of a batch's trained tokens, in their order
    (`finetune.objectives.teacher_table`)."""

    ids: torch.Tensor
    """(tokens, k) the teacher's k most likely next tokens, most likely first."""
    logps: torch.Tensor
    """(tokens, k) their log-probabilities over the whole vocabulary, fp32."""


@dataclass(frozen=True)
class TokenLosses:
    total: torch.Tensor
    """The sum over the trained tokens of divergence + ce_weight x cross-entropy; differentiable."""
    divergence: torch.Tensor
    """(tokens,) each trained token's divergence, detached."""
    cross_entropy: torch.Tensor
    """(tokens,) each trained token's cross-entropy (at temperature 1), detached."""


def token_divergence(student: torch.Tensor, teacher: torch.Tensor, spec: Spec) -> torch.Tensor:
    """(tokens,) each row's divergence between the distributions of two (tokens, vocab) logits, in fp32."""
    q = torch.log_softmax(student.float() / spec.temperature, dim=-1)
    p = torch.log_softmax(teacher.float() / spec.temperature, dim=-1)
    if spec.divergence == "forward_kl":
        return _kl(p, q)
    if spec.divergence == "reverse_kl":
        return _kl(q, p)
    beta = spec.beta
    mixture = torch.logsumexp(torch.stack([p + math.log(beta), q + math.log1p(-beta)]), dim=0)
    return beta * _kl(p, mixture) + (1 - beta) * _kl(q, mixture)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _token_losses(
    student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, spec: Spec, ids: torch.Tensor | None = None
):
    """(loss, divergence, cross-entropy), each (tokens,), of rows of logits. With the teacher's `ids` (its top k,
    `teacher` then their log-probabilities), the divergence is over those tokens alone, both distributions
    renormalized on them; the cross-entropy is the student's over the whole vocabulary."""
    on = student.float().gather(-1, ids) if ids is not None else student
    divergence = token_divergence(on, teacher, spec)
    cross_entropy = F.cross_entropy(student.float(), targets, reduction="none")
    return divergence + spec.ce_weight * cross_entropy, divergence, cross_entropy


def distill_losses(
    student: torch.nn.Module, teacher: torch.nn.Module | TopK, batch: Batch, path: LossPath, spec: Spec
) -> TokenLosses:
    """The batch's trained tokens' losses: the teacher's forward (no gradients), then the student's. A `TopK`
    teacher is its table's entries for the batch (`finetune.objectives.teacher_table`): no forward, the divergence
    over them."""
    kept = target_positions(batch)
    targets = batch["target_ids"].reshape(-1).index_select(0, kept)
    table = teacher if isinstance(teacher, TopK) else None
    if path == "full_logits":
        if table is None:
            with torch.no_grad():
                teacher_logits = teacher(**model_inputs(teacher, batch), use_cache=False).logits
            teacher_rows, ids = teacher_logits.flatten(0, 1).index_select(0, kept), None
        else:
            teacher_rows, ids = table.logps, table.ids
        logits = student(**model_inputs(student, batch), use_cache=False).logits.flatten(0, 1).index_select(0, kept)
        losses, divergence, cross_entropy = _token_losses(logits, teacher_rows, targets, spec, ids)
        return TokenLosses(losses.sum(), divergence.detach(), cross_entropy.detach())
    if table is None:
        with torch.no_grad(), head_inputs(output_head(teacher), kept) as captured:
            teacher(**model_inputs(teacher, batch), use_cache=False, logits_to_keep=0)
        teacher_part: tuple[torch.Tensor | None, ...] = (*captured, None, None)
    else:
        teacher_part = (None, None, None, table.logps, table.ids)
    head = output_head(student)
    parts: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)
        with_grads = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
        total, divergence, cross_entropy = _LinearDistill.apply(
            hidden, head.weight, head.bias, *teacher_part, targets, spec, with_grads
        )
        parts.extend((divergence, cross_entropy))
        return torch.stack([total])  # a new tensor leaving the unit, as finetune.objectives.loss's head returns

    with head_forward(head, forward):
        total = student(**model_inputs(student, batch), use_cache=False, logits_to_keep=0).logits.reshape(())
    return TokenLosses(total, *parts)


def sampled_reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, batch: Batch, path: LossPath,
                       spec: Spec) -> TokenLosses:  # fmt: skip
    """Reverse KL estimated at the tokens the student sampled (the batch's targets, its own completions at
    `spec.temperature`): per token k = log q(x) - log p(x), an unbiased estimate of KL(q || p) at that position, and
    k x grad log q(x) (k held constant) an unbiased estimate of its gradient, since the expectation of grad log q
    under q is 0. The returned total's value is the sum of the estimates and its gradient the sum of those
    policy-gradient terms: the negative advantage -k of each token, with the importance ratio of a fresh sample, 1.
    No cross-entropy (the tokens are the student's own): `cross_entropy` is empty."""
    with torch.no_grad():
        teacher_logps = token_logps(teacher, batch, path, spec.temperature)
    total, estimates = sampled_token_losses(token_logps(student, batch, path, spec.temperature), teacher_logps)
    return TokenLosses(total, estimates, estimates.new_zeros(0))


def sampled_token_losses(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, estimates) of sampled tokens' log-probabilities under each model: the estimates log q - log p
    (detached), and a total whose value is their sum and whose gradient is the sum of estimate x grad log q."""
    estimates = (student_logps - teacher_logps).detach()
    return (estimates + estimates * (student_logps - student_logps.detach())).sum(), estimates


@contextlib.contextmanager
def head_inputs(head: torch.nn.Linear, kept: torch.Tensor) -> Iterator[list[torch.Tensor | None]]:
    """While inside, the teacher's head, called by its forward, keeps what a chunk of its logits is made of: its last
    hidden states at the `kept` positions, and copies of its weight and bias (gathered inside the forward, and
    resharded after it: a copy outlives that)."""
    kept_parts: list[torch.Tensor | None] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        bias = head.bias.detach().clone() if head.bias is not None else None
        kept_parts.extend((hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept), head.weight.detach().clone(),
                           bias))  # fmt: skip
        return hidden.new_zeros(1)

    with head_forward(head, forward):
        yield kept_parts


class _LinearDistill(torch.autograd.Function):
    """sum over rows of divergence(hidden @ weight.T + bias, teacher_hidden @ teacher_weight.T + teacher_bias)
    + ce_weight x cross-entropy, a chunk of rows at a time; returns (sum, per-row divergences, per-row
    cross-entropies). A table's teacher comes as its log-probabilities and their ids instead of hidden states and a
    head: the divergence is then over those ids. With gradients asked for, each chunk's gradients with respect to the
    student's hidden states, weight and bias are computed while its logits exist; backward scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        teacher_hidden: torch.Tensor | None,
        teacher_weight: torch.Tensor | None,
        teacher_bias: torch.Tensor | None,
        table_logps: torch.Tensor | None,
        table_ids: torch.Tensor | None,
        targets: torch.Tensor,
        spec: Spec,
        with_grads: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A quarter of the cross-entropy's chunk: a chunk holds several logits-sized tensors of each model at once.
        rows = max(1, chunk_rows(weight.shape[0], weight.device) // 4)
        divergence = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        cross_entropy = torch.zeros_like(divergence)
        grad_hidden = torch.zeros_like(hidden) if with_grads and ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads and ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if with_grads and ctx.needs_input_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            chunk = slice(start, start + rows)
            h = hidden[chunk]
            if table_ids is None:
                teacher_logits, ids = F.linear(teacher_hidden[chunk], teacher_weight, teacher_bias), None
            else:
                teacher_logits, ids = table_logps[chunk], table_ids[chunk]
            logits = F.linear(h, weight, bias).float().requires_grad_(with_grads)
            with torch.enable_grad():
                losses, divergence[chunk], cross_entropy[chunk] = _token_losses(
                    logits, teacher_logits, targets[chunk], spec, ids
                )
                summed = losses.sum()
                if with_grads:
                    (grad_logits,) = torch.autograd.grad(summed, logits)
            total += summed.detach()
            if not with_grads:
                continue
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t().float(), h.float())
        ctx.mark_non_differentiable(divergence, cross_entropy)
        grads = (grad_hidden, grad_weight, grad_bias)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total, divergence, cross_entropy

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = [
            (grad * grad_total).to(dtype) if needed else None
            for grad, dtype, needed in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3], strict=True)
        ]
        return (*grads, None, None, None, None, None, None, None, None)
