"""The baseline for finetune's loop overhead: the shortest correct FSDP2 training loop in plain torch.

    torchrun --nproc_per_node 2 bench/handwritten_fsdp2.py MODEL_DIR ROWS.pt STEPS MICRO_BATCH OUT.json

Same model (from_pretrained), same packed rows (saved by bench/run.py from finetune's own data
pipeline), same micro-batch, AdamW and gradient clipping; one FSDP unit per decoder layer plus the
root, as finetune's configs wrap (accelerate 1.15 also gives the embedding and the final norm + head
units of their own: measured alike here, 0.75 s vs 0.76 s per step). It writes the wall time of every step.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


def main(model_dir: str, rows_path: str, steps: int, micro_batch: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    rows = torch.load(rows_path)
    per_step = micro_batch * world
    times, losses = [], []
    for step in range(steps):
        began = time.perf_counter()
        start = (step * per_step + rank * micro_batch) % (len(rows["input_ids"]) - micro_batch)
        batch = {key: value[start : start + micro_batch] for key, value in rows.items()}
        # use_cache=False as finetune does: with a cache transformers does not read packed position_ids as
        # sample boundaries, and attention would cross the packed samples.
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target_ids"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - began)
    if rank == 0:
        with open(out_path, "w") as file:
            json.dump({"step_seconds": times, "loss": losses}, file)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, rows_path, steps, micro_batch, out_path = sys.argv[1:6]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(model_dir, rows_path, int(steps), int(micro_batch), out_path)
