"""loss_path: train.loss_path chunked vs full_logits: step peak, bytes saved for backward, tokens/s"""

from __future__ import annotations

import json
import statistics
import sys

from common import REPO, Bench, _row, _run


def measure(bench: Bench) -> dict:
    """train.loss_path chunked vs full_logits on a head-dominated shape (vocabulary 128,256, hidden 64, a row of
    2,048 tokens, fp32, one process; bench/loss_path.py): step peak and bytes saved for backward as
    fractions of the fp32 logits' size, and tokens/s, each path in processes of its own, interleaved."""
    vocab, hidden, rows, steps = (8192, 64, 256, 2) if bench.quick else (128_256, 64, 2048, 5)
    runs: dict[str, list[dict]] = {"chunked": [], "full_logits": []}
    for repeat in range(bench.repeats):
        for path in runs:
            out = bench.work / "runs" / f"loss-{path}-{repeat}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            shape = [str(value) for value in (vocab, hidden, rows, steps)]
            _run([sys.executable, str(REPO / "bench" / "loss_path.py"), path, *shape, str(out)])
            runs[path].append(json.loads(out.read_text()))
    logits = rows * vocab * 4
    median = {
        path: {
            "step_peak_over_logits": statistics.median(r["step_peak"] / logits for r in results),
            "saved_over_logits": statistics.median(r["saved_for_backward"] / logits for r in results),
            "tokens_per_second": statistics.median(rows / statistics.median(r["step_seconds"]) for r in results),
        }
        for path, results in runs.items()
    }
    return {
        "shape": {"vocab": vocab, "hidden": hidden, "rows": rows, "dtype": "float32", "processes": 1},
        "fp32_logits_bytes": logits,
        "median": median,
        "tokens_per_second_ratio": median["chunked"]["tokens_per_second"] / median["full_logits"]["tokens_per_second"],
        "targets": {"step_peak_over_logits": 0.3, "saved_over_logits": 0.05, "tokens_per_second_ratio": 0.95},
    }


def rows(loss: dict) -> list[str]:
    shape, median, targets = loss["shape"], loss["median"], loss["targets"]
    memory = [
        _row(
            f"loss chunked, {label} ({shape['vocab']:,} vocabulary, hidden {shape['hidden']}, {shape['rows']:,} "
            "tokens, fp32)", f"{median['chunked'][key]:.3f}x", f"{median['full_logits'][key]:.3f}x (full logits)", "",
            f"<= {targets[key]}x",
        )
        for label, key in (
            ("step peak / fp32 logits", "step_peak_over_logits"),
            ("saved for backward / fp32 logits", "saved_over_logits"),
        )
    ]  # fmt: skip
    return [
        *memory,
        _row(
            "loss chunked, tokens/s (same shape)", f"{median['chunked']['tokens_per_second']:.0f}",
            f"{median['full_logits']['tokens_per_second']:.0f} (full logits)",
            f"{loss['tokens_per_second_ratio']:.2f}x", f">= {targets['tokens_per_second_ratio']}x",
        ),
    ]  # fmt: skip
