"""The TRL peer for preference tuning: `DPOTrainer` (full fine-tuning, or with PEFT adapters), DDP, on the same pairs.

    torchrun --nproc_per_node 2 bench/trl_dpo.py MODEL_DIR PAIRS.jsonl STEPS MICRO_BATCH MAX_LENGTH RANK OUT.json \
        PRECOMPUTE

TRL as a user would run it: chosen and rejected of a batch padded into one forward, the sigmoid loss with beta
0.1. PRECOMPUTE 0 is its defaults: the reference model loaded beside the policy and run every step (with
adapters, the policy with its adapters switched off instead). PRECOMPUTE 1 is its best settings for the same work:
`precompute_ref_log_probs=True`, every pair's reference log-probabilities computed once before training (for full
fine-tuning the reference model is then not kept). What TRL 1.16 cannot do: its `padding_free` is disabled for DPO
("temporarily unavailable after a refactor") and falls back to padding, so there is no packed DPO to compare with.
RANK 0 trains every weight; RANK > 0 trains LoRA adapters of that rank on every linear layer, alpha 2 x RANK, no
dropout, as the finetune side does. It writes the wall time of every optimizer step, the pairs it trained on over
all processes, and the seconds its precompute pass took (0 without it).
"""

from __future__ import annotations

import sys

import datasets
import torch
import torch.distributed as dist
from peers import PrecomputeClock, StepClock, close_ddp, lora_settings, train_counted, trainer_settings, write_steps
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer


def main(
    model_dir: str, pairs_path: str, steps: int, micro_batch: int, max_length: int, rank: int, out: str,
    precompute: bool,
) -> None:  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = datasets.load_dataset("json", data_files=pairs_path, split="train")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    arguments = DPOConfig(
        **trainer_settings(out, micro_batch, steps, max_length), learning_rate=1e-5, beta=0.1,
        precompute_ref_log_probs=precompute,
    )  # fmt: skip
    precomputing = PrecomputeClock(DPOTrainer)
    # The token slots (padding included) and the real tokens each step computed on.
    clock = StepClock({"slots": lambda b: b["input_ids"].numel(), "tokens": lambda b: int(b["attention_mask"].sum())})
    trainer = DPOTrainer(
        model=model, args=arguments, train_dataset=pairs, processing_class=tokenizer, peft_config=lora_settings(rank),
        callbacks=[clock],
    )  # fmt: skip
    train_counted(trainer, clock.count)
    pairs = [micro_batch * dist.get_world_size()] * len(clock.step_seconds)
    write_steps(
        out, clock.step_seconds, pairs=pairs, **clock.counted,
        precompute_seconds=precomputing.seconds,
    )  # fmt: skip
    del trainer, model  # before the process group goes (close_ddp)
    close_ddp()


if __name__ == "__main__":
    model_dir, pairs_path, steps, micro_batch, max_length, rank, out, precompute = sys.argv[1:9]
    main(model_dir, pairs_path, int(steps), int(micro_batch), int(max_length), int(rank), out, precompute == "1")
