"""The peer for target tokens per second: `transformers.Trainer` with DDP on the same chat data.

    torchrun --nproc_per_node 2 bench/trainer_ddp.py MODEL_DIR DATA.jsonl STEPS MICRO_BATCH OUT.json

Trainer cannot run FSDP on CPU, so it runs DDP (its CPU default over gloo). Samples are tokenized
and masked exactly as finetune does (`finetune.data.encode_chats`: loss on assistant turns only)
and padded per batch to the longest sample, as Trainer's usual collator does. It writes the wall
time and the target (non-masked) tokens of every step, counted over all processes.
"""

from __future__ import annotations

import sys
import time

import datasets
import torch
import torch.distributed as dist
from peers import close_ddp, write_steps
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from finetune.data import encode_chats


class StepClock(TrainerCallback):
    """Wall time and global target tokens of each optimizer step."""

    def __init__(self, collator: CountingCollator):
        self.collator = collator
        self.step_seconds: list[float] = []
        self.target_tokens: list[int] = []
        self.began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self.began)
        count = torch.tensor([self.collator.targets_since_last_step()])
        dist.all_reduce(count)
        self.target_tokens.append(int(count))


class CountingCollator(DataCollatorForSeq2Seq):
    """Pads to the longest sample and counts the target tokens it hands out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets = 0

    def __call__(self, features, return_tensors=None):
        batch = super().__call__(features, return_tensors)
        self.targets += int((batch["labels"] != -100).sum())
        return batch

    def targets_since_last_step(self) -> int:
        count, self.targets = self.targets, 0
        return count


def encode(batch: dict, tokenizer) -> dict:
    out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for ids, trained in encode_chats(batch["messages"], tokenizer, completion_only=True):
        out["input_ids"].append(ids)
        out["attention_mask"].append([1] * len(ids))
        # Trainer's causal LM loss shifts labels itself: label i is the target of position i - 1.
        out["labels"].append([t if m else -100 for t, m in zip(ids, trained, strict=True)])
    return out


def main(model_dir: str, data_path: str, steps: int, micro_batch: int, out_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    raw = datasets.load_dataset("json", data_files=data_path, split="train")
    train = raw.map(encode, fn_kwargs={"tokenizer": tokenizer}, batched=True, remove_columns=raw.column_names)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    collator = CountingCollator(tokenizer, padding="longest", label_pad_token_id=-100)
    clock = StepClock(collator)
    arguments = TrainingArguments(
        output_dir=out_path + ".trainer",
        per_device_train_batch_size=micro_batch,
        max_steps=steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        report_to=[],
        logging_steps=steps,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=train, data_collator=collator, callbacks=[clock])
    trainer.train()
    write_steps(out_path, clock.step_seconds, target_tokens=clock.target_tokens)
    del trainer, model  # before the process group goes (close_ddp)
    close_ddp()


if __name__ == "__main__":
    model_dir, data_path, steps, micro_batch, out_path = sys.argv[1:6]
    main(model_dir, data_path, int(steps), int(micro_batch), out_path)
