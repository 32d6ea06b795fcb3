"""The reward-model demo: a scorer of the demo's list reversals that online RL can be rewarded by alone.

A reward model trained only on the demo's fixed near misses (two neighbouring digits swapped) scores what it has
seen; GRPO then finds the replies it has not seen that it scores high, and is rewarded for them (measured: the
policy's exact match fell). What a reward model must rank are the policy's own replies, so `build` samples them:
the policy GRPO starts from writes `samples` replies to each training and evaluation list, as GRPO samples them
(its temperature), and each wrong reply becomes a pair with the correct reversal (`rm_pairs_train.jsonl`,
`rm_pairs_eval.jsonl`; labelled by the answer: RLHF's human labels, here exact). Beside them, hard negatives that
sampling seldom writes and a scorer must still rank below the answer: a near miss, the answer with one digit changed
at each position in turn, and the list not reversed. One changed digit is the error a scorer misses most (measured: a
reward model with such negatives at the first or last digit only ranked a changed middle digit above the answer
about one time in six among the policy's replies, and GRPO rewarded by it drifted toward writing them); with one at
every position it ranks the policy's replies 97% right, after GRPO has moved the policy too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune.errors import FinetuneError
from finetune.run.demo import near_miss


def build(workdir: str, policy: str, samples: int = 8, temperature: float = 0.5, max_new_tokens: int = 16) -> None:
    """data/rm_pairs_{train,eval}.jsonl from the policy's replies to data/prompts_{train,eval}.jsonl; kept if there."""
    data = Path(workdir) / "data"
    if not (Path(policy) / "config.json").exists():
        raise FinetuneError(f"{policy} holds no model; train the policy first (make demo-rm trains the 40-step model)")
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy, padding_side="left")
    for split in ("train", "eval"):
        target = data / f"rm_pairs_{split}.jsonl"
        if target.exists():
            print(f"demo: reusing {target}")
            continue
        prompts = [json.loads(line) for line in (data / f"prompts_{split}.jsonl").read_text().splitlines()]
        torch.manual_seed(0 if split == "train" else 1)
        replies = _sample(model, tokenizer, prompts, samples, temperature, max_new_tokens)
        rng = random.Random(7 if split == "train" else 8)
        pairs, wrong, distinct = [], 0, 0
        for prompt, written in zip(prompts, replies, strict=True):
            answer = prompt["answer"]
            # An empty reply is no training text (finetune refuses it); the others, once each.
            rejected = sorted({reply for reply in written if reply not in (answer, "")})
            wrong += sum(reply != answer for reply in written)
            distinct += len(rejected)
            for reply in dict.fromkeys([*rejected, *hard_negatives(prompt["prompt"][0]["content"], answer, rng)]):
                pairs.append({"prompt": prompt["prompt"], "chosen": [{"role": "assistant", "content": answer}],
                              "rejected": [{"role": "assistant", "content": reply}]})  # fmt: skip
        rng.shuffle(pairs)
        partial = target.with_suffix(".partial")
        partial.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
        partial.replace(target)
        print(f"demo: wrote {target}: {len(pairs):,} pairs ({wrong:,} of {len(prompts) * samples:,} sampled replies "
              f"wrong, {distinct:,} distinct; with the hard negatives of each list)")  # fmt: skip


def hard_negatives(request: str, answer: str, rng: random.Random) -> list[str]:
    """A near miss, the answer with one digit changed at each position in turn, and the list as given (where it
    differs)."""
    digits = answer.split()
    changed = [
        " ".join([*digits[:i], str((int(digits[i]) + rng.randrange(1, 10)) % 10), *digits[i + 1 :]])
        for i in range(len(digits))
    ]
    unreversed = request.removeprefix("reverse: ")
    return [near_miss(answer, rng), *changed, *([unreversed] if unreversed != answer else [])]


@torch.no_grad()
def _sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[dict],
    samples: int,
    temperature: float,
    max_new_tokens: int,
) -> list[list[str]]:
    """Each prompt's `samples` replies as GRPO samples them (its temperature, no top-k or top-p), decoded as text;
    256 prompts a batch, left-padded."""
    replies = []
    for start in range(0, len(prompts), 256):
        chunk = prompts[start : start + 256]
        texts = [tokenizer.apply_chat_template(p["prompt"], tokenize=False, add_generation_prompt=True) for p in chunk]
        inputs = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
        output = model.generate(
            **inputs, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
            num_return_sequences=samples, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        written = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        replies += [[w.strip() for w in written[i * samples : (i + 1) * samples]] for i in range(len(chunk))]
    return replies
