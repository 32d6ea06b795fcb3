"""The TRL peer for online RL: `GRPOTrainer`, DDP, on the same model, prompts, group size and lengths.

    torchrun --nproc_per_node 2 bench/trl_grpo.py MODEL_DIR PROMPTS.jsonl STEPS PROMPTS_PER_PROCESS GENERATIONS \
        MAX_NEW_TOKENS OUT.json [CHECKPOINTING] [SEED]

TRL at its best for CPU: generation by transformers with a KV cache (no vLLM, which does not run on CPU; its
continuous batching, `use_transformers_paged=True`, took 13.5 s a step against 1.3 s without on this bench), the
same exact-reversal reward, DAPO's loss (its default), beta 0 (no reference model), one update per rollout,
dropout off (as finetune runs), fp32 and a constant learning rate as `peers.trainer_settings`. Its batch counts
completions: PROMPTS_PER_PROCESS x GENERATIONS per process, a rollout per step. It writes the wall time of every
optimizer step (generation included: TRL generates inside the step), the prompts each step answered and the
completions' mean length (TRL's `completions/mean_length`). CHECKPOINTING (1 or 0, default 1) is
`gradient_checkpointing`, on in GRPOConfig's defaults. SEED (default 0) seeds the prompts' order and the sampling:
the bench gives each repetition its own, so that repetitions draw other completions (a randomly initialised model's
completion lengths vary widely from one draw to the next) and the lengths compared are means over all of them.
"""

from __future__ import annotations

import gc
import sys
import time

import datasets
import torch
import torch.distributed as dist
from peers import close_ddp, trainer_settings, write_steps
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def reversed_exactly(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is the answer (both stripped): the demo's exact-match reward."""
    return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


class StepClock(TrainerCallback):
    def __init__(self):
        self.step_seconds: list[float] = []
        self.began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self.began)


def trained(
    model_dir: str, prompts_path: str, steps: int, prompts: int, generations: int, new_tokens: int, out: str,
    seed: int, reward, **options,
) -> GRPOTrainer:  # fmt: skip
    """GRPOTrainer run at the settings the module's docstring gives (and `options`: GRPOConfig's or the trainer's,
    by name), each optimizer step timed (`trainer.clock`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = datasets.load_dataset("json", data_files=prompts_path, split="train")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    settings = trainer_settings(out, prompts * generations, steps, 0)
    del settings["max_length"]  # GRPO's lengths are max_completion_length (prompts are whole)
    settings["seed"] = seed
    settings["logging_steps"] = 1  # each step's completion lengths (TRL averages its metrics over a logging window)
    trainer_options = {name: options.pop(name) for name in ("tools",) if name in options}
    arguments = GRPOConfig(
        **settings, learning_rate=1e-4, num_generations=generations, max_completion_length=new_tokens,
        temperature=1.0, top_p=1.0, beta=0.0, loss_type="dapo", disable_dropout=True, log_completions=False, **options,
    )  # fmt: skip
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model, args=arguments, train_dataset=data, processing_class=tokenizer, reward_funcs=reward,
        callbacks=[clock], **trainer_options,
    )  # fmt: skip
    trainer.clock = clock
    trainer.train()
    return trainer


def main(
    model_dir: str, prompts_path: str, steps: int, prompts: int, generations: int, new_tokens: int, out: str,
    checkpointing: bool, seed: int,
):  # fmt: skip
    trainer = trained(
        model_dir, prompts_path, steps, prompts, generations, new_tokens, out, seed, reversed_exactly,
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    clock = trainer.clock
    answered = [prompts * dist.get_world_size()] * len(clock.step_seconds)
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    write_steps(
        out, clock.step_seconds, prompts=answered, completion_tokens=sum(lengths) / max(len(lengths), 1),
        completion_tokens_per_step=lengths,
    )  # fmt: skip
    del trainer  # and the model it holds, before the process group goes (close_ddp)
    gc.collect()
    close_ddp()


if __name__ == "__main__":
    model_dir, prompts_path, steps, prompts, generations, new_tokens, out = sys.argv[1:8]
    checkpointing = sys.argv[8] != "0" if len(sys.argv) > 8 else True
    seed = int(sys.argv[9]) if len(sys.argv) > 9 else 0
    counts = int(steps), int(prompts), int(generations), int(new_tokens)
    main(model_dir, prompts_path, *counts, out, checkpointing, seed)
