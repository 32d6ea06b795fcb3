"""Online RL's loss of a completion token, and its sum over a micro-batch.

The loss of a completion token is PPO's clipped surrogate (TRL's definitions, equal to its `GRPOTrainer` on the
same log-probabilities, advantages and masks: tests/test_grpo.py):

    ratio = exp(logp - logp_old)        (1 when each rollout is trained on once: logp_old is logp, detached)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)  [+ beta * KL(policy, reference)]

summed as the loop's unit asks: dapo averages over every completion token of the step (the unit: a token),
grpo each completion's tokens and then over completions, dr_grpo sums a completion's and divides by
max_new_tokens (the unit: a completion). gspo takes the ratio of a whole completion, cispo weights the policy
gradient by the ratio clipped above (`token_losses` says how).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.config import RLConfig


@dataclass(frozen=True)
class TokenLosses:
    per_token: torch.Tensor
    """(tokens,) each completion token's loss, differentiable."""
    low_clipped: torch.Tensor
    """(tokens,) the ratio fell below 1 - epsilon where the advantage is negative (the clipped side bounds it)."""
    high_clipped: torch.Tensor
    kl: torch.Tensor | None
    """(tokens,) the per-token KL estimate to the reference (beta > 0), detached."""


def token_losses(
    cfg: RLConfig,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sequence: torch.Tensor,
    num_sequences: int,
) -> TokenLosses:
    """Each completion token's loss (and KL penalty), from its log-probability under the policy, at sampling, under
    the reference, its completion's advantage, whether it trains (`mask`) and its completion's number (`sequence`):
    all (tokens,). PPO's clipped surrogate of the token's ratio (grpo, dapo, dr_grpo) or of its completion's (gspo:
    the exponent of the mean log-ratio over the completion's trained tokens, GSPO's); cispo's policy gradient
    weighted by the ratio clipped above and held constant (MiniMax-M1's)."""
    log_ratio = logps - old_logps
    if cfg.loss == "gspo":
        zeros = log_ratio.new_zeros(num_sequences)
        counts = zeros.index_add(0, sequence, mask.to(log_ratio.dtype)).clamp(min=1)
        log_ratio = (zeros.index_add(0, sequence, log_ratio * mask) / counts).index_select(0, sequence)
    ratio = torch.exp(log_ratio)
    if cfg.loss == "cispo":
        # The weight never passes gradient, so a clipped token still trains (PPO's clip would zero it).
        weight = torch.clamp(ratio, max=1 + cfg.upper_epsilon).detach()
        per_token = -weight * advantages * logps
        low = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        clipped = torch.clamp(ratio, 1 - cfg.lower_epsilon, 1 + cfg.upper_epsilon)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        low = (ratio < 1 - cfg.lower_epsilon) & (advantages < 0)
    kl = None
    if cfg.beta:
        # k3, an unbiased estimate of KL(policy || reference) with low variance (Schulman's).
        difference = ref_logps - logps
        kl = torch.exp(difference) - difference - 1
        per_token = per_token + cfg.beta * kl
        kl = kl.detach()
    high = (ratio > 1 + cfg.upper_epsilon) & (advantages > 0)
    return TokenLosses(per_token, low.detach(), high.detach(), kl)


def summed_loss(
    cfg: RLConfig, per_token: torch.Tensor, mask: torch.Tensor, sequence: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """A micro-batch's loss summed over the objective's units (the loop divides by the step's units): dapo and
    cispo, the sum over tokens; grpo and gspo, each completion's mean over its tokens, summed; dr_grpo, each
    completion's sum over max_new_tokens, summed. `mask` (tokens,) is 0 where a token trains nothing, `sequence`
    its completion."""
    masked = per_token * mask
    if cfg.per_token:
        return masked.sum()
    if cfg.loss == "dr_grpo":
        return masked.sum() / cfg.max_new_tokens
    zeros = torch.zeros(num_sequences, dtype=masked.dtype, device=masked.device)
    counts = zeros.index_add(0, sequence, mask.to(masked.dtype))
    return (zeros.index_add(0, sequence, masked) / counts.clamp(min=1)).sum()
