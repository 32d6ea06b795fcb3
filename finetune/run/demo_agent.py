"""The agent demo: a small Llama learns to use a tool it cannot do without.

The task: "reverse list 4821" — the list is stored under its number, out of the model's sight; the tool
`lookup(key)` returns it ("3 1 4 1"), and the answer is the list reversed ("1 4 1 3"). Without the tool the model
can only guess. `build` writes, offline, a base model and tokenizer (a chat template of our own that renders tool
calls as `<|call|>{"name": ..., "arguments": {...}}` and results as a `tool` turn), SFT data (tool-using traces
among lists reversed without a tool: the model learns the skill, the call format and partly their combination;
the traces' tool results are lists of their own, so that reading the result is the only way to answer them, never
the key learnt by heart), and prompts with their answers for GRPO over episodes.
`report` plays the held-out prompts greedily as episodes (the same loop as training's, on one process) with a
model before and after, and prints `N/200` solved and the share of tool calls that were valid.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from finetune.errors import FinetuneError

NUM_TRACES, NUM_DIRECT, NUM_PROMPTS, NUM_EVAL, NUM_TEST = 1000, 3000, 4000, 64, 200
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|call|>"]
# Tools are listed by name in a system turn; each call is a JSON object after <|call|>; a result is a tool turn.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
    "<|end|>{% endif %}{% for message in messages %}{% if message['role'] == 'tool' %}<|tool|>{{ message['content'] }}"
    "<|end|>{% else %}<|{{ message['role'] }}|>{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<|call|>{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}{% endfor %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    """How the demo's tokenizer writes conversations: its chat template and the special tokens it names."""

    template: str = TEMPLATE
    special_tokens: tuple[str, ...] = tuple(SPECIAL_TOKENS)
    bos: str | None = "<|bos|>"
    eos: str = "<|end|>"
    pad: str = "<|pad|>"
    vocab_size: int = 320
    positions: int = 256
    """The model's context (a vendor's template writes a long system turn around the tools)."""


def stored_list(key: str) -> list[str]:
    """The list stored under `key` (digits apart, "5 1 6"): three to six digits, fixed by the key."""
    rng = random.Random(f"list {key}")
    return [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]


def lookup(key: str) -> str:
    """The list of digits stored under a key.

    Args:
        key: The list's key, its digits apart (for example "5 1 6").
    """
    if not isinstance(key, str) or not all(part.isdigit() and len(part) == 1 for part in key.split()):
        raise ValueError(f"no list has the key {key!r}; a key is digits apart, such as '5 1 6'")
    return " ".join(stored_list(" ".join(key.split())))


def _trace(key: str, rng: random.Random) -> list[dict]:
    """A conversation that solves the task: the call, its result, the answer. Recorded on another shelf: the list
    the tool returned is not the one `lookup` stores under the key (a model could learn the shelf by heart from
    the traces, instead of reading what the tool returns)."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
    return [
        {"role": "user", "content": f"reverse list {key}"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": " ".join(digits)},
        {"role": "assistant", "content": " ".join(reversed(digits))},
    ]


def _direct(rng: random.Random) -> list[dict]:
    """A conversation without the tool: a list given in the prompt, reversed (the skill the traces build on)."""
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
    return [
        {"role": "user", "content": "reverse " + " ".join(digits)},
        {"role": "assistant", "content": " ".join(reversed(digits))},
    ]


def _prompt(key: str) -> dict:
    answer = " ".join(reversed(stored_list(key)))
    return {"prompt": [{"role": "user", "content": f"reverse list {key}"}], "answer": answer}


def build(workdir: str, folder: str = "agent", chat: ChatFormat = ChatFormat()) -> Path:
    """Write `folder` under `workdir`: data/ (traces, prompts, held-out test prompts) and base/ (model and tokenizer,
    which writes conversations as `chat` says: the demo's own format unless a bench gives a vendor's); reuses what a
    previous build wrote. Returns the folder."""
    root = Path(workdir) / folder
    if (root / "base" / "config.json").exists():
        print(f"demo: reusing {root}/base and {root}/data")
        return root
    numbers = random.Random(4321).sample(range(10_000), NUM_TEST + NUM_EVAL + NUM_TRACES + NUM_PROMPTS)
    keys = [" ".join(f"{n:04d}") for n in numbers]
    test, rest = keys[:NUM_TEST], keys[NUM_TEST:]
    evaluation, traces = rest[:NUM_EVAL], rest[NUM_EVAL : NUM_EVAL + NUM_TRACES]
    prompts = rest[NUM_EVAL + NUM_TRACES :]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    tools = [_tool_schema()]
    rng = random.Random(99)
    direct = [{"messages": _direct(rng), "tools": None} for _ in range(NUM_DIRECT)]
    sft = [{"messages": _trace(k, rng), "tools": tools} for k in traces] + direct
    rng.shuffle(sft)
    files = {
        "sft_train": sft,
        "sft_eval": [{"messages": _trace(k, rng), "tools": tools} for k in evaluation],
        "prompts_train": [_prompt(k) for k in prompts],
        "prompts_eval": [_prompt(k) for k in evaluation],
        "test": [_prompt(k) for k in test],
    }
    for name, rows in files.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = _train_tokenizer(files["sft_train"] + files["sft_eval"], chat)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=chat.positions, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    partial = root / "base.partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(root / "base")
    print(f"demo: wrote {root}/base ({model.num_parameters():,} parameters) and {root}/data")
    return root


def _tool_schema() -> dict:
    from transformers.utils import get_json_schema

    schema = get_json_schema(lookup)
    schema["function"].pop("return", None)
    return schema


def _train_tokenizer(rows: list[dict], chat: ChatFormat) -> PreTrainedTokenizerFast:
    texts = []
    wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=chat.template)
    for row in rows:
        texts.append(wrapped.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=chat.vocab_size, special_tokens=list(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=chat.bos, eos_token=chat.eos, pad_token=chat.pad,
        chat_template=chat.template,
    )  # fmt: skip


def report(workdir: str, run: str, before: str) -> None:
    """Held-out prompts played greedily as episodes by the model before and after: solved, and valid calls."""
    from finetune.rollouts.episodes import Agent, Episode, play
    from finetune.rollouts.tool_calls import tool_template
    from finetune.rollouts.tools import load_tools

    root = Path(workdir) / "agent"
    rows = [json.loads(line) for line in (root / "data" / "test.jsonl").read_text().splitlines()]
    tools = load_tools(["finetune.run.demo_agent:lookup"])
    lines = []
    for label, folder in (("before", Path(before)), ("after", Path(run) / "final")):
        if not (folder / "config.json").exists():
            raise FinetuneError(f"{folder} holds no model; run `make demo-agent` (it builds and trains first)")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        agent = Agent(tokenizer, tool_template(tokenizer), tools, None, 3, 10.0, [tokenizer.eos_token_id])
        schemas = agent.schemas
        episodes = []
        for start in range(0, len(rows), 50):
            batch = [
                Episode(tokenizer.apply_chat_template(r["prompt"], tools=schemas, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False),
                        {t.name: t for t in tools}, schemas)
                for r in rows[start : start + 50]
            ]  # fmt: skip
            with torch.no_grad():
                play(model, batch, agent, tokenizer.pad_token_id, 96, None, False, 1)
            episodes += batch
        solved = sum(_final(e) == r["answer"] for e, r in zip(episodes, rows, strict=True))
        calls = sum(e.counts["calls"] for e in episodes)
        failed = sum(e.counts["error"] + e.counts["unknown"] + e.counts["timeout"] for e in episodes)
        lines.append(
            f"{label:<8}{f'{solved}/{len(rows)}':>10} solved   tool calls valid {calls - failed}/{calls}"
            f"   {sum(e.counts['turns'] for e in episodes) / len(episodes):.2f} turns an episode"
        )
        if label == "after":
            examples = list(zip(rows[:3], episodes[:3], strict=True))
    print(f"\nheld-out prompts: {len(rows)} lists never seen in training, played as episodes (greedy)\n")
    print("\n".join(lines))
    print("\nexamples (after):")
    for row, episode in examples:
        calls = [c["function"] for m in episode.messages for c in m.get("tool_calls") or []]
        results = [m["content"] for m in episode.messages if m["role"] == "tool"]
        pairs = zip(calls, results, strict=False)  # a call the episode's budget cut has no result
        called = ", ".join(f"{c['name']}({json.dumps(c['arguments'])}) -> {r!r}" for c, r in pairs)
        mark = "ok " if _final(episode) == row["answer"] else "bad"
        print(f"  [{mark}] {row['prompt'][0]['content']!r}: {called or 'no call'}; answered {_final(episode)!r}")


def _final(episode: object) -> str:
    """An episode's final answer: its last assistant message's text, stripped (an episode still calling: none)."""
    messages = [m for m in episode.messages if m["role"] == "assistant"]
    if not messages or messages[-1].get("tool_calls") or episode.end != "answer":
        return ""
    return str(messages[-1]["content"]).strip()
