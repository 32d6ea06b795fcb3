"""Model FLOPs and the peak FLOP/s of known GPUs: the two halves of MFU.

MFU (model FLOPs utilization) = achieved model FLOP/s / the device's peak dense FLOP/s. Model
FLOPs count the math the model needs, not what the run does: activation checkpointing recomputes
the forward but is not credited, so MFU is comparable across settings. For a batch:

    6 * N * tokens             forward (2N) + backward (4N) through the N non-embedding parameters
                               a token goes through, the output head included (the input embedding is
                               a lookup; of a mixture of experts' routed experts, the router's top k)
    + 6 * L * d_attn * sum(n^2)  attention scores and weighted sum, causal (half of 12 * L * n^2 * d_attn
                               per sample of n tokens), d_attn = heads * head_dim

(the formula of the PaLM paper, appendix B, with causal masking halving the attention term). The
attention term counts each sample of a packed row on its own: a row of four 512-token samples needs a
quarter of the attention math of one 2,048-token sample, whatever a kernel with a dense block mask
computes. That is what the varlen path computes, and what makes MFU comparable across the paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.engine.batch import Batch
from finetune.model.family import active_parameters

# Dense bf16/fp16 tensor-core peaks (no sparsity) from the vendors' data sheets, in FLOP/s.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # an H100 whose form factor the name does not say: assume SXM
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


@dataclass(frozen=True)
class ModelFlops:
    per_token: float
    """6 N: the matmuls' FLOPs of one trained token."""
    per_squared_length: float
    """6 L d_attn: a sample of n tokens costs this times n^2 in attention."""

    def batch(self, batch: Batch, num_tokens: int | torch.Tensor) -> torch.Tensor:
        """Model FLOPs of one micro-batch, on its device (no host sync)."""
        return self.per_token * num_tokens + self.per_squared_length * squared_sample_lengths(batch)


def squared_sample_lengths(batch: Batch) -> torch.Tensor:
    """The sum of n^2 over the batch's samples, from positions: a sample of n tokens has positions 0..n-1
    and sum(2p + 1) over them is n^2. Packed rows carry their `position_ids` (a row's padding is one more
    short run at its end); padded rows count the positions their mask keeps."""
    if "position_ids" in batch:
        odd = 2 * batch["position_ids"].double() + 1
        # Padded rows split over a sequence group carry their global positions beside the mask.
        return (odd * batch["attention_mask"]).sum() if "attention_mask" in batch else odd.sum()
    rows, length = batch["input_ids"].shape
    odd = 2 * torch.arange(length, device=batch["input_ids"].device, dtype=torch.float64) + 1
    if "attention_mask" in batch:
        return (batch["attention_mask"] * odd).sum()
    return rows * odd.sum()


def model_flops(model: torch.nn.Module) -> ModelFlops:
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings()
    tied = embedding is not None and embedding.weight is getattr(model.get_output_embeddings(), "weight", None)
    parameters = active_parameters(model)
    # The input embedding is a lookup, unless it is also the output head (then it is a matmul).
    if embedding is not None and not tied:
        parameters -= embedding.weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelFlops(6 * parameters, 6 * config.num_hidden_layers * config.num_attention_heads * head_dim)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward) in a sample of `seq_len` tokens."""
    counts = model_flops(model)
    return counts.per_token + counts.per_squared_length * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` when it is a GPU this table knows, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
