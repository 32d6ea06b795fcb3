"""One loss path (`train.loss_path`) on a head-dominated model, in a process of its own so that its memory
high-water mark is its own: a Llama with a large vocabulary and a small hidden size, one row of
`rows` tokens, every position a target, fp32, one process.

    python bench/loss_path.py chunked|full_logits VOCAB HIDDEN ROWS STEPS OUT.json

Writes the resident-set growth of the first step (forward + backward: the step peak), the bytes
autograd saved for backward in its forward, and the wall time of each later step.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.engine.memory import _peak, _reset_peak
from finetune.objectives.loss import batch_loss


def saved_bytes(path: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward (parameters excluded)."""
    parameters = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in parameters:
            seen[tensor.data_ptr()] = max(seen.get(tensor.data_ptr(), 0), tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = batch_loss(model, batch, path).total
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main() -> None:
    path, vocab, hidden, rows, steps, out = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=rows, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, vocab, (1, rows), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, -1] = -100
    batch = {"input_ids": input_ids, "target_ids": targets}
    before = _reset_peak(torch.device("cpu"))
    batch_loss(model, batch, path).total.backward()  # gradients stay allocated, as between micro-batches
    peak = _peak(torch.device("cpu")) - before
    saved = saved_bytes(path, model, batch)
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        batch_loss(model, batch, path).total.backward()
        model.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - began)
    logits_bytes = rows * vocab * 4
    result = {"step_peak": peak, "saved_for_backward": saved, "step_seconds": seconds, "fp32_logits": logits_bytes}
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
