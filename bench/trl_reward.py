"""The TRL peer for reward models: `RewardTrainer` (full fine-tuning), DDP, on the same pairs.

    torchrun --nproc_per_node 2 bench/trl_reward.py MODEL_DIR PAIRS.jsonl STEPS MICRO_BATCH MAX_LEN OUT.json RECOMPUTE

TRL as a user would run it, at its best on CPU: the causal LM loaded as a sequence classifier with one label (its
default), chosen and rejected of a micro-batch padded into one forward (RewardTrainer has no padding-free or
packed mode), the Bradley-Terry loss with `center_rewards_coefficient` 0.01 as finetune's demo sets it. RECOMPUTE 1
is RewardConfig's default, gradient checkpointing on (each layer's forward redone in backward: time traded for
activation memory); 0 turns it off (TRL at its fastest, every activation kept). It writes
the wall time of every optimizer step, the pairs it trained on over all processes, and the token slots (padding
included) and real tokens each step computed on.
"""

from __future__ import annotations

import sys

import datasets
import torch
import torch.distributed as dist
from peers import StepClock, close_ddp, train_counted, trainer_settings, write_steps
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer


def main(
    model_dir: str, pairs_path: str, steps: int, micro_batch: int, max_length: int, out: str, recompute: bool
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = datasets.load_dataset("json", data_files=pairs_path, split="train")
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.float32, pad_token_id=tokenizer.pad_token_id
    )
    arguments = RewardConfig(
        **trainer_settings(out, micro_batch, steps, max_length),
        learning_rate=1e-5,
        center_rewards_coefficient=0.01,
        gradient_checkpointing=recompute,
    )
    clock = StepClock({"slots": lambda b: b["input_ids"].numel(), "tokens": lambda b: int(b["attention_mask"].sum())})
    trainer = RewardTrainer(model=model, args=arguments, train_dataset=pairs, processing_class=tokenizer,
                            callbacks=[clock])  # fmt: skip
    train_counted(trainer, clock.count)
    write_steps(out, clock.step_seconds, pairs=[micro_batch * dist.get_world_size()] * len(clock.step_seconds),
                **clock.counted)  # fmt: skip
    del trainer, model  # before the process group goes (close_ddp)
    close_ddp()


if __name__ == "__main__":
    model_dir, pairs_path, steps, micro_batch, max_length, out, recompute = sys.argv[1:8]
    main(model_dir, pairs_path, int(steps), int(micro_batch), int(max_length), out, recompute == "1")
