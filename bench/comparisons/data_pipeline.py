"""data_pipeline: tokenize + mask vs a batched render + tokenize datasets.map; + pack, first and cached"""

from __future__ import annotations

import gc
import shutil
import statistics
import time

from common import Bench, _row


def long_chats(conversations: list[list[dict]], count: int, turns: int = 3, per_turn: int = 40) -> list[dict]:
    """`count` multi-turn chats of about 2,000 demo tokens: each message joins `per_turn` of the demo's."""
    chats, pool = [], iter(conversations * (count * turns * per_turn // max(len(conversations), 1) + 1))
    for _ in range(count):
        messages = []
        for _ in range(turns):
            pieces = [next(pool) for _ in range(per_turn)]
            for role, position in (("user", 0), ("assistant", 1)):
                messages.append({"role": role, "content": " ".join(chat[position]["content"] for chat in pieces)})
        chats.append({"messages": messages})
    return chats


def measure(bench: Bench) -> dict:
    """finetune's tokenization with assistant-only masking vs a batched `datasets.map` that only renders the
    chat template and tokenizes, on the demo's short chats and on long multi-turn chats made of them (medians
    of repetitions interleaved A, B, B, A, ..., nothing cached, each kept in the results); and tokenize + mask +
    pack, the first time and cached."""
    import datasets
    from transformers import AutoTokenizer

    from finetune.config import DataConfig
    from finetune.data import prepare_split
    from finetune.data.tokenize import tokenize

    tokenizer = AutoTokenizer.from_pretrained(bench.work / "demo" / "base")
    cache = bench.work / "datasets-cache"
    shutil.rmtree(cache, ignore_errors=True)
    short = datasets.load_dataset("json", data_files=str(bench.data), split="train", cache_dir=str(cache))
    if bench.quick:
        short = short.select(range(500))
    long = datasets.Dataset.from_list(long_chats(list(short["messages"]), len(short) // 10))
    cfg = DataConfig(train_path=str(bench.data), max_length=1 << 16, format="chat", packing=True)

    def plain(data: datasets.Dataset) -> datasets.Dataset:
        return data.map(
            lambda batch: tokenizer(tokenizer.apply_chat_template(batch["messages"], tokenize=False)),
            batched=True, remove_columns=data.column_names,
        )  # fmt: skip

    contenders = {
        "finetune_tokenize_mask": lambda data: tokenize(data, tokenizer, cfg),
        "plain_batched_map": plain,
    }
    sets: dict[str, dict] = {}
    datasets.disable_caching()  # every repetition computes
    try:
        for name, data in (("short", short), ("long", long)):
            seconds: dict[str, list[float]] = {contender: [] for contender in contenders}
            for repeat in range(3 * bench.repeats):  # seconds each: more repetitions against the noise
                # A, B then B, A: whatever running second (or first) costs falls on both alike.
                order = list(contenders.items())[:: 1 if repeat % 2 == 0 else -1]
                for contender, run in order:
                    gc.collect()  # as timeit does: the collector's pauses otherwise fall on either contender
                    gc.disable()
                    try:
                        began = time.perf_counter()
                        out = run(data)
                        seconds[contender].append(time.perf_counter() - began)
                    finally:
                        gc.enable()
            median = {contender: statistics.median(values) for contender, values in seconds.items()}
            tokens = sum(len(ids) for ids in out["input_ids"])
            sets[name] = {
                "samples": len(data), "tokens_per_sample": tokens / len(data), "seconds": median,
                "ratio_vs_plain": median["plain_batched_map"] / median["finetune_tokenize_mask"],
                "repetitions": {contender: [round(v, 4) for v in values] for contender, values in seconds.items()},
            }  # fmt: skip
    finally:
        datasets.enable_caching()
    timings = {}
    for label in ("first", "cached"):
        began = time.perf_counter()
        _, stats = prepare_split(short, tokenizer, cfg, seed=42)
        timings[label] = time.perf_counter() - began
    return {
        "metric": "tokens_per_second",
        "target_ratio_vs_plain": 0.9,
        "sets": sets,
        "pack_rate": {label: stats.num_tokens / seconds for label, seconds in timings.items()},
    }


def rows(data: dict) -> list[str]:
    rows = [
        _row(
            f"tokenize + mask vs batched render + tokenize map, s ({sets['samples']} {name} chats, "
            f"{sets['tokens_per_sample']:.0f} tokens each)", f"{sets['seconds']['finetune_tokenize_mask']:.2f}",
            f"{sets['seconds']['plain_batched_map']:.2f}", f"{sets['ratio_vs_plain']:.2f}x",
            f">= {data['target_ratio_vs_plain']}x",
        )
        for name, sets in data["sets"].items()
    ]  # fmt: skip
    rate = data["pack_rate"]
    return [
        *rows,
        _row(
            "tokenize + mask + pack, tokens/s (short chats)",
            f"first {rate['first']:.0f}",
            f"cached {rate['cached']:.0f}",
        ),
    ]
