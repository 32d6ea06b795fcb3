"""Where an on-policy distillation step's signal lands, on the demo (docs/distillation.md, issue #65).

The student completes held-out prompts at temperature 1 as an on-policy step does; the teacher grades every token.
A completion is compared with the correct reply token by token: its first wrong token splits it into the tokens
before (the teacher agrees with the data there), the first wrong token (where a grade can teach the fix) and the
tokens after it (conditioned on a wrong prefix, which the teacher never saw in its own training). Printed: the
share of tokens in each part, the reverse and forward KL (over the whole vocabulary) at each, how long the
completions are and how many end; and how often the teacher's most likely token after a wrong prefix is still the
one the correct reply has at that place (whether its grades there teach reversal or noise).

    python bench/distill_signal.py --student STUDENT --teacher TEACHER --data outputs/demo/data/test.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--data", required=True, help="chat jsonl: a user message and the correct reply")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    student, teacher = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
                        for p in (args.student, args.teacher))  # fmt: skip
    lines = Path(args.data).read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines][: args.samples]
    parts = {"before": [], "first wrong": [], "after": []}
    lengths, ended, realigned, after_total = [], 0, 0, 0
    torch.manual_seed(args.seed)
    for messages in conversations:
        prompt = _ids(tokenizer, messages[:1], add_generation_prompt=True)
        reply = _ids(tokenizer, messages)[len(prompt) :]
        with torch.no_grad():
            out = student.generate(torch.tensor([prompt]), do_sample=True, temperature=args.temperature, top_k=0,
                                   top_p=1.0, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            completion = out[0, len(prompt) :].tolist()
            ids = torch.tensor([prompt + completion])
            q = torch.log_softmax(student(ids).logits[0, len(prompt) - 1 : -1] / args.temperature, dim=-1)
            p = torch.log_softmax(teacher(ids).logits[0, len(prompt) - 1 : -1] / args.temperature, dim=-1)
        reverse = (q.exp() * (q - p)).sum(-1)
        forward = (p.exp() * (p - q)).sum(-1)
        lengths.append(len(completion))
        ended += completion[-1] == tokenizer.eos_token_id
        wrong = next((i for i, token in enumerate(completion) if i >= len(reply) or token != reply[i]), None)
        for i in range(len(completion)):
            part = "before" if wrong is None or i < wrong else "first wrong" if i == wrong else "after"
            parts[part].append((reverse[i].item(), forward[i].item()))
            if part == "after" and i < len(reply):
                after_total += 1
                realigned += int(p[i].argmax()) == reply[i]
    tokens = sum(len(v) for v in parts.values())
    count, mean = len(conversations), sum(lengths) / len(lengths)
    print(f"{count} completions at temperature {args.temperature}: {mean:.2f} tokens on average, {ended}/{count} "
          f"end (EOS); {len(parts['first wrong'])} have a wrong token")  # fmt: skip
    print(f"{'tokens':<14}{'share':>8}{'reverse KL':>13}{'forward KL':>13}")
    for name, values in parts.items():
        if values:
            share = len(values) / tokens
            reverse_kl, forward_kl = (sum(v[k] for v in values) / len(values) for k in (0, 1))
            print(f"{name:<14}{share:>8.1%}{reverse_kl:>13.3f}{forward_kl:>13.3f}")
    if after_total:
        print(f"after a wrong token, the teacher's most likely token is the correct reply's at that place "
              f"{realigned}/{after_total} times")  # fmt: skip


def _ids(tokenizer, messages: list[dict], **options) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer(text, add_special_tokens=False).input_ids


if __name__ == "__main__":
    main()
