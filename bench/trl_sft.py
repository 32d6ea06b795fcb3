"""The TRL peer: `SFTTrainer` (with PEFT adapters, or full fine-tuning), DDP, on the same chat data.

    torchrun --nproc_per_node 2 bench/trl_sft.py MODEL_DIR DATA.jsonl STEPS MICRO_BATCH MAX_LENGTH RANK OUT.json \
        [router_aux]

Set up as TRL's own documentation advises for speed: packing (best-fit decreasing) into rows of
MAX_LENGTH tokens with padding-free batches. Samples are given already tokenized and masked exactly as
finetune does (`finetune.data.encode_chats`: loss on assistant turns), as `input_ids` plus TRL's
`completion_mask`, so both train on the same target tokens. LoRA on every linear layer with rank RANK,
alpha 2 x RANK, no dropout: what the finetune side runs; RANK 0 trains every weight instead. Like
`trainer_ddp.py`, it writes the wall time and the target tokens (positions with a label, counted over
all processes) of every step. `router_aux`: a mixture of experts adds its routers' balancing loss.
"""

from __future__ import annotations

import sys

import datasets
import torch
from peers import StepClock, close_ddp, lora_settings, target_tokens, train_counted, trainer_settings, write_steps
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from finetune.data import encode_chats


def encode(batch: dict, tokenizer) -> dict:
    out: dict[str, list] = {"input_ids": [], "completion_mask": []}
    for ids, trained in encode_chats(batch["messages"], tokenizer, completion_only=True):
        out["input_ids"].append(ids)
        out["completion_mask"].append([int(m) for m in trained])
    return out


def main(
    model_dir: str,
    data_path: str,
    steps: int,
    micro_batch: int,
    max_length: int,
    rank: int,
    out: str,
    router_aux: bool,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    raw = datasets.load_dataset("json", data_files=data_path, split="train")
    train = raw.map(encode, fn_kwargs={"tokenizer": tokenizer}, batched=True, remove_columns=raw.column_names)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # A mixture of experts adds its routers' balancing loss to the loss it computes from labels only when asked.
    model.config.output_router_logits = router_aux
    arguments = SFTConfig(
        **trainer_settings(out, micro_batch, steps, max_length),
        learning_rate=1e-4,
        packing=True,
        padding_free=True,
        completion_only_loss=True,
    )
    clock = StepClock({"target_tokens": target_tokens})
    trainer = SFTTrainer(
        model=model, args=arguments, train_dataset=train, processing_class=tokenizer, peft_config=lora_settings(rank),
        callbacks=[clock],
    )  # fmt: skip
    train_counted(trainer, clock.count)
    write_steps(out, clock.step_seconds, **clock.counted)
    del trainer, model  # before the process group goes (close_ddp)
    close_ddp()


if __name__ == "__main__":
    model_dir, data_path, steps, micro_batch, max_length, rank, out = sys.argv[1:8]
    router_aux = sys.argv[8:] == ["router_aux"]
    main(model_dir, data_path, int(steps), int(micro_batch), int(max_length), int(rank), out, router_aux)
