"""The offline demo: a small Llama learns to reverse lists of digits, a task with checkable answers.

`build` writes everything the demo recipe needs without any network: chat datasets (train, eval
and a held-out test set whose lists never occur in training), a byte-level BPE tokenizer trained
on that data with `tokenizers`, and a randomly initialised Llama saved with `save_pretrained`.
`report` reloads the base model and the exported fine-tuned model with `from_pretrained` and
compares them on the held-out set: loss per answer token and exact-match accuracy of greedy answers.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from finetune.data import IGNORE, encode_chats
from finetune.errors import FinetuneError

NUM_TRAIN, NUM_EVAL, NUM_TEST = 6000, 200, 200
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Prefix-stable: rendering the first k messages gives a prefix of rendering all of them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_example(rng: random.Random) -> dict:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
    return {
        "messages": [
            {"role": "user", "content": "reverse: " + " ".join(digits)},
            {"role": "assistant", "content": " ".join(reversed(digits))},
        ]
    }


def build(workdir: str, noise: float | None = None) -> None:
    """Write data/, base/ (model + tokenizer) under `workdir`; reuses what a previous build wrote. With `noise`,
    also data/train_noisy.jsonl (`write_noisy`)."""
    if noise is not None and not 0 <= noise <= 1:
        raise FinetuneError(f"--noise is the share of training replies made wrong, between 0 and 1; got {noise}")
    root = Path(workdir)
    _build(root)
    if noise is not None:
        write_noisy(root / "data", noise)


def _build(root: Path) -> None:
    if (root / "base" / "config.json").exists():
        print(f"demo: reusing {root}/base and {root}/data")
        _write_pairs(root / "data")  # a build from before the preference data had none
        _write_prompts(root / "data")  # or the prompts of online RL
        _write_student(root, AutoTokenizer.from_pretrained(root / "base"))  # or distillation's student
        return
    splits = _write_data(root / "data")
    _write_pairs(root / "data")
    _write_prompts(root / "data")
    tokenizer = _train_tokenizer(splits["train"])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    partial = root / "base.partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(root / "base")
    _write_student(root, tokenizer)
    print(f"demo: wrote {root}/base ({model.num_parameters():,} parameters) and {root}/data")


def _write_student(root: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """student/: the base's architecture at half its layers and width, randomly initialised, with its tokenizer:
    what `make demo-distill` teaches from the trained demo model (kept if already there)."""
    if (root / "student" / "config.json").exists():
        return
    base = LlamaConfig.from_pretrained(root / "base")
    config = LlamaConfig(**{
        **base.to_diff_dict(), "hidden_size": base.hidden_size // 2, "intermediate_size": base.intermediate_size // 2,
        "num_hidden_layers": base.num_hidden_layers // 2, "num_attention_heads": base.num_attention_heads // 2,
        "num_key_value_heads": max(1, base.num_key_value_heads // 2),
    })  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    partial = root / "student.partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(root / "student")


def _write_data(data_dir: Path) -> dict[str, list[dict]]:
    rng = random.Random(1234)
    splits: dict[str, list[dict]] = {"test": [], "eval": [], "train": []}
    held_out: set[str] = set()
    for name, size in (("test", NUM_TEST), ("eval", NUM_EVAL), ("train", NUM_TRAIN)):
        while len(splits[name]) < size:
            example = make_example(rng)
            prompt = example["messages"][0]["content"]
            if prompt in held_out:
                continue  # test and eval lists are distinct and never appear in training
            if name != "train":
                held_out.add(prompt)
            splits[name].append(example)
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, examples in splits.items():
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    return splits


def near_miss(reply: str, rng: random.Random) -> str:
    """A wrong reversal close to `reply`: two neighbouring digits of it swapped (or, where they are equal, one of them
    changed)."""
    digits = reply.split()
    wrong = list(digits)
    i = rng.randrange(len(wrong) - 1)
    wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
    if wrong == digits:
        wrong[i] = str((int(wrong[i]) + 1) % 10)
    return " ".join(wrong)


def _write_pairs(data_dir: Path) -> None:
    """Preference pairs for `make demo-dpo` (pairs_train.jsonl, pairs_eval.jsonl), from the train and eval
    lists: the correct reversal preferred over a near miss."""
    rng = random.Random(99)

    def pair(user: dict, reply: dict) -> dict:
        rejected = {"role": "assistant", "content": near_miss(reply["content"], rng)}
        return {"prompt": [user], "chosen": [reply], "rejected": [rejected]}

    _derive(data_dir, "pairs", pair)


def write_noisy(data_dir: Path, fraction: float) -> Path:
    """data/train_noisy.jsonl: the training lists, with the replies of about `fraction` of them wrong the same way
    every time (a systematic labelling error, which SFT learns as a rule): the lists whose first digit is below
    10 x fraction (rounded: 0.3 takes 0, 1 and 2) reversed with their last two digits swapped (or, where those are
    equal, the last one changed). The distillation demo's second case: a teacher trained on the correct replies
    knows more than this data. Rewritten at every call (the fraction may differ), atomically."""
    below = round(10 * fraction)
    lines, wrong = [], 0
    for line in (data_dir / "train.jsonl").read_text().splitlines():
        example = json.loads(line)
        user, reply = example["messages"]
        if int(user["content"].split()[1]) < below:
            example["messages"][1] = {**reply, "content": _swap_last(reply["content"])}
            wrong += 1
        lines.append(json.dumps(example) + "\n")
    target = data_dir / "train_noisy.jsonl"
    partial = target.with_suffix(".partial")
    partial.write_text("".join(lines))
    partial.replace(target)
    print(f"demo: wrote {target} ({wrong:,} of {len(lines):,} replies wrong: the lists whose first digit is below "
          f"{below}, their last two digits swapped)")  # fmt: skip
    return target


def _swap_last(reply: str) -> str:
    digits = reply.split()
    if digits[-1] == digits[-2]:
        return " ".join([*digits[:-1], str((int(digits[-1]) + 1) % 10)])
    return " ".join([*digits[:-2], digits[-1], digits[-2]])


def _write_prompts(data_dir: Path) -> None:
    """Prompts for `make demo-grpo` (prompts_train.jsonl, prompts_eval.jsonl), TRL's prompt-only layout: each list's
    request as the prompt, its reversal as the `answer` the exact-match reward compares with."""
    _derive(data_dir, "prompts", lambda user, reply: {"prompt": [user], "answer": reply["content"]})


def _derive(data_dir: Path, prefix: str, sample: Callable[[dict, dict], dict]) -> None:
    """`<prefix>_train.jsonl` and `<prefix>_eval.jsonl`, a sample made of each conversation's user and assistant
    messages; a file already there is kept."""
    for name in ("train", "eval"):
        target = data_dir / f"{prefix}_{name}.jsonl"
        if not target.exists():
            conversations = [json.loads(line)["messages"] for line in (data_dir / f"{name}.jsonl").open()]
            target.write_text("".join(json.dumps(sample(user, reply)) + "\n" for user, reply in conversations))


def _train_tokenizer(examples: list[dict]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [m["content"] for e in examples for m in e["messages"]]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )


def exported_model(output_dir: Path) -> Path:
    """The model folder a run exported: `final/`, or for an adapter run (whose `final/` is the adapter)
    the merged model in `final_merged/`."""
    final = output_dir / "final"
    return output_dir / "final_merged" if (final / "adapter_config.json").exists() else final


def report(workdir: str, output_dir: str = "outputs/demo/run", before: str | None = None) -> None:
    """Print before vs after (the base, or `before`: the supervised run a preference run started from) loss
    and exact-match accuracy on the held-out test set; for a preference run also how often each model
    prefers the correct reversal of a held-out pair, and the reward accuracy of the trained one."""
    root = Path(workdir)
    base_dir, tuned_dir = Path(before) if before else root / "base", exported_model(Path(output_dir))
    for folder in (base_dir, tuned_dir):
        if not (folder / "config.json").exists():
            raise FinetuneError(
                f"{folder} holds no model; run `make demo` or `make demo-lora` (they build, train and export first)"
            )
    examples = [json.loads(line) for line in (root / "data" / "test.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tuned_dir)
    pairs_file = root / "data" / "pairs_eval.jsonl"
    saved = Path(output_dir) / "recipe.yaml"  # the run's resolved recipe: was it preference tuning?
    settings = (yaml.safe_load(saved.read_text()) or {}) if saved.is_file() else {}
    preference, online = settings.get("preference") is not None, settings.get("rl") is not None
    distilled = settings.get("distill") is not None
    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines()] if preference else []
    first = "before (supervised)" if before else "base (random init)"
    rows, logps = [], []
    second = "after (preference)" if pairs else "after (online RL)" if online else "fine-tuned (exported)"
    if distilled:  # the same student trained by SFT, against it distilled
        first, second = ("student by SFT" if before else first), "student distilled"
    for label, folder in ((first, base_dir), (second, tuned_dir)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        loss = _answer_loss(model, tokenizer, examples)
        correct, samples = _exact_match(model, tokenizer, examples)
        rows.append((label, loss, correct, samples))
        if pairs:
            logps.append(_pair_logps(model, tokenizer, pairs))
    print(f"\nheld-out test set: {len(examples)} lists never seen in training\n")
    print(f"{'model':<24}{'loss/answer token':>20}{'exact match':>20}" + ("  prefers correct" if pairs else ""))
    for (label, loss, correct, _), *pair_logps in itertools.zip_longest(rows, logps):
        line = f"{label:<24}{loss:>20.4f}{f'{correct}/{len(examples)} ({100 * correct / len(examples):.1f}%)':>20}"
        if pair_logps and pair_logps[0] is not None:
            chosen, rejected = pair_logps[0]
            line += f"{f'{int((chosen > rejected).sum())}/{len(pairs)}':>18}"
        print(line)
    if pairs:
        (before_chosen, before_rejected), (after_chosen, after_rejected) = logps
        margins = (after_chosen - before_chosen) - (after_rejected - before_rejected)
        print(
            f"\nheld-out pairs ({len(pairs)}, correct reversal vs a near miss): reward accuracy of the tuned model "
            f"{int((margins > 0).sum())}/{len(pairs)} (its log-ratio to the model it started from is higher for the "
            "correct reply)"
        )
    print("\nexamples (fine-tuned):")
    for prompt, expected, answer in rows[-1][3][:5]:
        mark = "ok " if answer == expected else "bad"
        print(f"  [{mark}] {prompt!r} -> {answer!r} (expected {expected!r})")


def report_distill(workdir: str, warm: str, sft: str, distilled: list[str], case: str) -> None:
    """The distillation demo's comparison at equal steps from one warm student: the warm student, its continued SFT
    and each distilled run, on the held-out test set (loss per answer token, exact match); then the best
    distillation against SFT, in points of exact match."""
    examples = [json.loads(line) for line in (Path(workdir) / "data" / "test.jsonl").read_text().splitlines()]
    runs = [("warm student (SFT start)", Path(warm)), ("SFT, continued", exported_model(Path(sft)))]
    for run in map(Path, distilled):
        saved = yaml.safe_load((run / "recipe.yaml").read_text())["distill"]
        fraction = saved["on_policy_fraction"]
        how = "off-policy" if fraction == 0 else "on-policy" if fraction == 1 else f"{fraction:.0%} on-policy"
        estimated = ", sampled" if saved.get("estimator") == "sampled" else ""
        runs.append((f"distilled {how}, {saved['divergence']}{estimated}", exported_model(run)))
    tokenizer = AutoTokenizer.from_pretrained(runs[1][1])
    print(f"\n{case}: held-out test set of {len(examples)} lists never seen in training, each run from the warm "
          "student for the same steps\n")  # fmt: skip
    print(f"{'model':<44}{'loss/answer token':>20}{'exact match':>20}")
    scores = []
    for label, folder in runs:
        if not (folder / "config.json").exists():
            raise FinetuneError(f"{folder} holds no model; run `make demo-distill` (it trains and exports each run)")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        correct, _ = _exact_match(model, tokenizer, examples)
        scores.append(correct)
        score = f"{correct}/{len(examples)} ({100 * correct / len(examples):.1f}%)"
        print(f"{label:<44}{_answer_loss(model, tokenizer, examples):>20.4f}{score:>20}")
    best = max(scores[2:])
    names = " = ".join(label for (label, _), score in zip(runs[2:], scores[2:], strict=True) if score == best)
    gain = 100 * (best - scores[1]) / len(examples)
    print(f"\n{case}: the best distillation ({names}) {gain:+.1f} points of exact match against SFT")


@torch.no_grad()
def _answer_loss(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, examples: list[dict]) -> float:
    total, count = 0.0, 0
    for ids, trained in encode_chats([example["messages"] for example in examples], tokenizer, completion_only=True):
        targets = [ids[i + 1] if trained[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        targets = torch.tensor(targets)
        total += torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum").item()
        count += int((targets != IGNORE).sum())
    return total / count


@torch.no_grad()
def _pair_logps(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, pairs: list[dict]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed log-probabilities of each pair's chosen and rejected reply (through its end-of-turn)."""
    sides = []
    for side in ("chosen", "rejected"):
        values = []
        for ids, trained in encode_chats([pair["prompt"] + pair[side] for pair in pairs], tokenizer, True):
            log_probs = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
            values.append(sum(log_probs[i - 1, ids[i]].item() for i in range(1, len(ids)) if trained[i]))
        sides.append(torch.tensor(values))
    return sides[0], sides[1]


@torch.no_grad()
def _exact_match(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, examples: list[dict]
) -> tuple[int, list[tuple[str, str, str]]]:
    correct, samples = 0, []
    for example in examples:
        prompt_messages, expected = example["messages"][:1], example["messages"][1]["content"]
        text = tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        output = model.generate(
            input_ids,
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True).strip()
        correct += answer == expected
        samples.append((prompt_messages[0]["content"], expected, answer))
    return correct, samples
