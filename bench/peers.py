"""What the peer scripts (trainer_ddp.py and the trl_*.py) share: the TRL trainers' settings, writing their step
timings and precompute seconds, leaving DDP cleanly."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import TrainerCallback


class StepClock(TrainerCallback):
    """Wall time of each optimizer step, and what each of `counters` counts of the batches its collator made
    (a number a batch, by name), summed over the step's batches and all processes."""

    def __init__(self, counters: dict[str, Callable[[dict], int]]):
        self.counters = counters
        self.step_seconds: list[float] = []
        self.counted: dict[str, list[int]] = {name: [] for name in counters}
        self.counts = torch.zeros(len(counters), dtype=torch.int64)
        self.began = 0.0

    def count(self, batch: dict) -> dict:
        self.counts += torch.tensor([counter(batch) for counter in self.counters.values()])
        return batch

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self.began)
        dist.all_reduce(self.counts)
        for name, value in zip(self.counters, self.counts.tolist(), strict=True):
            self.counted[name].append(value)
        self.counts = torch.zeros(len(self.counters), dtype=torch.int64)


class PrecomputeClock:
    """The seconds `trainer_class` (a TRL trainer) spends in its reference precompute passes, which run while the
    trainer is built."""

    def __init__(self, trainer_class: type):
        self.seconds = 0.0
        timed = trainer_class._precompute_ref_logps

        def precompute(trainer, *args, **kwargs):
            began = time.perf_counter()
            try:
                return timed(trainer, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        trainer_class._precompute_ref_logps = precompute


def target_tokens(batch: dict) -> int:
    """The positions with a label (the model shifts labels by one)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def write_steps(path: str, step_seconds: list[float], **counts: list[int] | float) -> None:
    """The wall time and the global counts (target tokens, pairs) of every step, written once (by rank 0)."""
    if dist.get_rank() == 0:
        with open(path, "w") as file:
            json.dump({"step_seconds": step_seconds, **counts}, file)


def close_ddp() -> None:
    """End the process group with every rank in step, after the caller dropped its trainer and model: a rank
    that exits while DDP's gloo threads still run aborts ("terminate called without an active exception")."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train_counted(trainer, count) -> None:
    """Train `trainer` with `count` shown every batch its collator makes (what the steps compute on)."""
    collate = trainer.data_collator
    trainer.data_collator = lambda features: count(collate(features))
    trainer.train()


def trainer_settings(out: str, micro_batch: int, steps: int, max_length: int) -> dict:
    """What the TRL peers set alike: CPU DDP over gloo, fp32 as finetune runs here (TRL's configs default to bf16
    autocast, on CPU too, which on a CPU with bf16 instructions halves the matmuls' time and the activations'
    memory: measured against an fp32 run, that compares precisions, not trainers), a constant learning rate,
    clipping at 1, no saving or reporting, logs once, no loader workers, seeded."""
    return dict(
        output_dir=out + ".trl", per_device_train_batch_size=micro_batch, max_steps=steps, bf16=False,
        lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=True, ddp_backend="gloo", save_strategy="no",
        report_to=[], logging_steps=steps, dataloader_num_workers=0, seed=0, max_length=max_length,
    )  # fmt: skip


def lora_settings(rank: int):
    """LoRA as the finetune side trains it (every linear layer, alpha 2 x rank, no dropout); None for rank 0."""
    from peft import LoraConfig

    if rank <= 0:
        return None
    return LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
