"""The TRL peer for KTO: `KTOTrainer` (full fine-tuning), DDP, on the same unpaired samples.

    torchrun --nproc_per_node 2 bench/trl_kto.py MODEL_DIR SAMPLES.jsonl STEPS MICRO_BATCH MAX_LENGTH OUT.json \
        PRECOMPUTE

TRL as a user would run it: each micro-batch's samples and their mismatched partners (its completions cycled by
one, for the reference point) padded, beta 0.1, weights 1. PRECOMPUTE 0 is its defaults: the reference model
loaded beside the policy and run every step on both; PRECOMPUTE 1 is its best for the same work:
`precompute_ref_log_probs=True`, the reference's log-probabilities computed once before training and the reference
model not kept. It writes the wall time of every optimizer step, the samples it trained on over all processes, the
token slots (padding included) and real tokens of the samples (not their partners), and its precompute seconds.
"""

from __future__ import annotations

import sys

import datasets
import torch
import torch.distributed as dist
from peers import PrecomputeClock, StepClock, close_ddp, train_counted, trainer_settings, write_steps
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig, KTOTrainer


def main(
    model_dir: str, samples_path: str, steps: int, micro_batch: int, max_length: int, out: str, precompute: bool
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = datasets.load_dataset("json", data_files=samples_path, split="train")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    arguments = KTOConfig(
        **trainer_settings(out, micro_batch, steps, max_length), learning_rate=1e-5, beta=0.1,
        precompute_ref_log_probs=precompute,
    )  # fmt: skip
    precomputing = PrecomputeClock(KTOTrainer)
    clock = StepClock({"slots": lambda b: b["input_ids"].numel(), "tokens": lambda b: int(b["attention_mask"].sum())})
    trainer = KTOTrainer(model=model, args=arguments, train_dataset=samples, processing_class=tokenizer,
                         callbacks=[clock])  # fmt: skip
    train_counted(trainer, clock.count)
    count = [micro_batch * dist.get_world_size()] * len(clock.step_seconds)
    write_steps(out, clock.step_seconds, samples=count, **clock.counted, precompute_seconds=precomputing.seconds)
    del trainer, model  # before the process group goes (close_ddp)
    close_ddp()


if __name__ == "__main__":
    model_dir, samples_path, steps, micro_batch, max_length, out, precompute = sys.argv[1:8]
    main(model_dir, samples_path, int(steps), int(micro_batch), int(max_length), out, precompute == "1")
