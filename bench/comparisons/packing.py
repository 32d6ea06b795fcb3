"""packing:"""

from __future__ import annotations

import time

from common import Bench, _row


def measure(bench: Bench) -> dict:
    """Rows' fill (real tokens / row slots) and the packing's own rate, best-fit decreasing (finetune's, within
    each window of 2,000 samples) against next-fit (a row closed at the first sample that does not fit, as
    finetune packed before): on the demo's chats (rows of 256) and on UltraChat-like lengths (log-normal,
    median ~1,000 tokens, cut at the row length) in rows of 2,048 and 8,192."""
    import datasets
    import numpy
    from transformers import AutoTokenizer

    from finetune.config import DataConfig
    from finetune.data.pack import WINDOW, best_fit, next_fit
    from finetune.data.tokenize import tokenize

    tokenizer = AutoTokenizer.from_pretrained(bench.work / "demo" / "base")
    demo = datasets.load_dataset("json", data_files=str(bench.data), split="train")
    demo = tokenize(demo, tokenizer, DataConfig(train_path=str(bench.data), max_length=256, format="chat"))
    rng = numpy.random.default_rng(0)
    count = 4 * WINDOW if bench.quick else 25 * WINDOW
    synthetic = numpy.exp(rng.normal(numpy.log(1000), 0.7, count)).astype(int)
    sets = {"demo chats, rows of 256": ([len(ids) for ids in demo["input_ids"]], 256)}
    for capacity in (2048, 8192):
        sets[f"UltraChat-like, rows of {capacity:,}"] = (numpy.clip(synthetic, 8, capacity).tolist(), capacity)
    results = {}
    for name, (lengths, capacity) in sets.items():
        windows = [lengths[start : start + WINDOW] for start in range(0, len(lengths), WINDOW)]
        row = {"samples": len(lengths), "tokens": int(sum(lengths))}
        for packer, pack in (("best_fit", best_fit), ("next_fit", next_fit)):
            began = time.perf_counter()
            rows = sum(len(pack(window, capacity)) for window in windows)
            row[packer] = {"rows": rows, "fill": sum(lengths) / (rows * capacity),
                           "samples_per_second": len(lengths) / (time.perf_counter() - began)}  # fmt: skip
        results[name] = row
    return {"target_fill": 0.97, "window": WINDOW, "sets": results}


def rows(packing: dict) -> list[str]:
    return [
        _row(
            f"packed rows' fill, best fit vs next fit ({name}, {row['samples']:,} samples)",
            f"{row['best_fit']['fill']:.3f} ({row['best_fit']['rows']:,} rows)",
            f"{row['next_fit']['fill']:.3f} ({row['next_fit']['rows']:,} rows)",
            f"{row['next_fit']['rows'] / row['best_fit']['rows']:.2f}x fewer rows",
            f">= {packing['target_fill']} fill",
        )
        for name, row in packing["sets"].items()
    ]
