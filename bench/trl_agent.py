"""The TRL peer for agents: `GRPOTrainer` with tools, DDP, on the same model, prompts, tool, turns and budget.

    torchrun --nproc_per_node 2 bench/trl_agent.py MODEL_DIR PROMPTS.jsonl STEPS PROMPTS_PER_PROCESS GENERATIONS \
        MAX_NEW_TOKENS MAX_TURNS OUT.json SEED

The settings of bench/trl_grpo.py (generation by transformers with a KV cache, DAPO's loss, beta 0, one update per
rollout, dropout off, fp32, gradient checkpointing off: on, it runs each layer's forward twice for memory this
small run does not need) with the demo agent's tool, `finetune.run.demo_agent:lookup`, passed as `tools`
(through a copy without its return annotation: TRL renders a function's schema whole, finetune without the
`return` entry, and the two prompts must be the same).
TRL counts every id after the prompt, the tool's answers too, against `max_completion_length`, as finetune's
`rl.max_new_tokens` does; its `max_tool_calling_iterations` is the number of times tools answer, one less than
finetune's `rl.max_turns` (model turns). The reward is the exact reversal, read from the episode's last message
as finetune's `exact_match` does. It writes each optimizer step's wall time, and per step the ids the model wrote
per episode (TRL's `completions/mean_length`, which with tools counts only those) and TRL's
`tools/call_frequency`.
"""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist
from peers import close_ddp, write_steps
from trl_grpo import trained

from finetune.run import demo_agent


def lookup(key: str):
    """The list of digits stored under a key.

    Args:
        key: The list's key, its digits apart (for example "5 1 6").
    """
    return demo_agent.lookup(key)


def reversed_exactly(completions, answer, **kwargs) -> list[float]:
    """1.0 when the episode's last message is the answer (both stripped)."""
    return [float(str(c[-1]["content"]).strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def main(
    model_dir: str, prompts_path: str, steps: int, prompts: int, generations: int, new_tokens: int, turns: int,
    out: str, seed: int,
):  # fmt: skip
    trainer = trained(
        model_dir, prompts_path, steps, prompts, generations, new_tokens, out, seed, reversed_exactly,
        gradient_checkpointing=False, max_tool_calling_iterations=turns - 1, tools=[lookup],
    )  # fmt: skip
    logged = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    write_steps(
        out, trainer.clock.step_seconds, prompts=[prompts * dist.get_world_size()] * len(trainer.clock.step_seconds),
        completion_tokens_per_step=[e["completions/mean_length"] for e in logged],
        calls_per_step=[e.get("tools/call_frequency", 0.0) for e in logged],
    )  # fmt: skip
    del trainer  # and the model it holds, before the process group goes (close_ddp)
    gc.collect()
    close_ddp()


if __name__ == "__main__":
    model_dir, prompts_path, steps, prompts, generations, new_tokens, turns, out, seed = sys.argv[1:10]
    counts = int(steps), int(prompts), int(generations), int(new_tokens), int(turns)
    main(model_dir, prompts_path, *counts, out, int(seed))
