"""The TRL peer for distillation: `GKDTrainer` (trl.experimental.gkd), DDP, on the same chat data, student and teacher.

    torchrun --nproc_per_node 2 bench/trl_gkd.py STUDENT_DIR TEACHER_DIR DATA.jsonl STEPS MICRO_BATCH MAX_LENGTH \
        LMBDA MAX_NEW_TOKENS CHECKPOINTING OUT.json

TRL as its documentation runs GKD: the conversations (`messages`) collated by its ChatML collator (padded, the
replies trained), the generalized JSD with beta 0.5 at temperature 1, the teacher prepared beside the student.
LMBDA 0 trains on the data's replies (off-policy); LMBDA 1 on the student's own completions of MAX_NEW_TOKENS
(on-policy, sampled by transformers' `generate`). CHECKPOINTING 1 turns on gradient checkpointing (TRL's
configs default to it for GKD's generation runs; the faster of the two is TRL at its best). fp32 and DDP over gloo,
as the finetune side. It writes the wall time of every optimizer step and the samples each trained, over all
processes.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from peers import StepClock, close_ddp, target_tokens, train_counted, trainer_settings, write_steps  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402


def main(
    student: str, teacher: str, data_path: str, steps: int, micro_batch: int, max_length: int, lmbda: float,
    max_new_tokens: int, checkpointing: bool, out: str,
) -> None:  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(student)
    train = datasets.load_dataset("json", data_files=data_path, split="train")
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    arguments = GKDConfig(
        **trainer_settings(out, micro_batch, steps, max_length), learning_rate=1e-4, lmbda=lmbda, beta=0.5,
        temperature=1.0, max_new_tokens=max_new_tokens, gradient_checkpointing=checkpointing,
    )  # fmt: skip
    clock = StepClock({"samples": lambda b: b["input_ids"].shape[0], "target_tokens": target_tokens})
    trainer = GKDTrainer(
        model=model, teacher_model=teacher_model, args=arguments, train_dataset=train, processing_class=tokenizer,
        callbacks=[clock],
    )  # fmt: skip
    train_counted(trainer, clock.count)
    write_steps(out, clock.step_seconds, **clock.counted)
    del trainer, model, teacher_model  # before the process group goes (close_ddp)
    close_ddp()


if __name__ == "__main__":
    student, teacher, data_path, steps, micro_batch, max_length, lmbda, new_tokens, checkpointing, out = sys.argv[1:11]
    main(student, teacher, data_path, int(steps), int(micro_batch), int(max_length), float(lmbda), int(new_tokens),
         checkpointing == "1", out)  # fmt: skip
