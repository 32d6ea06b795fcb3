"""Model FLOPs per token and the peak FLOP/s of known GPUs: the two halves of MFU.

MFU (model FLOPs utilization) = achieved model FLOP/s / the device's peak dense FLOP/s. Model
FLOPs count the math the model needs, not what the run does: activation checkpointing recomputes
the forward but is not credited, so MFU is comparable across settings. Per trained token:

    6 * N                      forward (2N) + backward (4N) through the N non-embedding parameters
                               and the output head (the input embedding is a lookup)
    + 6 * L * s * d_attn       attention scores and weighted sum, causal (half of 12 * L * s * d_attn),
                               with s the sequence length and d_attn = heads * head_dim

(the formula of the PaLM paper, appendix B, with causal masking halving the attention term).
"""

from __future__ import annotations

import torch

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


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward) at sequence length `seq_len`."""
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings()
    tied = embedding is not None and embedding.weight is getattr(model.get_output_embeddings(), "weight", None)
    parameters = sum(p.numel() for p in model.parameters())
    # The input embedding is a lookup, unless it is also the output head (then it is a matmul).
    if embedding is not None and not tied:
        parameters -= embedding.weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * seq_len * config.num_attention_heads * head_dim
    return 6 * parameters + attention


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` when it is a GPU this table knows, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
