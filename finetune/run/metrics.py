"""Metrics: a JSONL file, accelerate trackers and a progress bar, all on the main process.

Metric names are stable: loss, lr, grad_norm, tokens_per_second, eval_loss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from tqdm.auto import tqdm


class MetricsLogger:
    """Writes one JSON object per logged step to `metrics.jsonl` and forwards it to the trackers."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: Path,
        max_steps: int,
        tracker_config: dict[str, Any],
        trackers: list[str],
        progress: str | None = None,
    ):
        """`progress`: the metric the progress bar shows beside the loss (`Objective.progress_name`), if any."""
        self.accelerator = accelerator
        self.progress = progress
        self.max_steps = max_steps
        self.enabled = accelerator.is_main_process
        self.path = output_dir / "metrics.jsonl"
        self.bar = tqdm(total=max_steps, desc="training", disable=not self.enabled, dynamic_ncols=True)
        if trackers:
            accelerator.init_trackers("finetune", config=_flatten(tracker_config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.accelerator.log(metrics, step=step)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json_line({"step": step, **metrics}) + "\n")
        if "loss" in metrics:
            shown = {"loss": f"{metrics['loss']:.4f}"}
            if self.progress in metrics:
                shown[self.progress.rsplit("/", 1)[-1]] = f"{metrics[self.progress]:.2f}"
            shown |= {"lr": f"{metrics['lr']:.2e}", "tok_s": f"{metrics['tokens_per_second']:.0f}"}
            self.bar.set_postfix(shown)

    def say(self, line: str) -> None:
        """A line of the log while training (main process), above the progress bar rather than after it."""
        if self.enabled:
            self.bar.write(line)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def close(self) -> None:
        """End the progress bar and the trackers. The process group is left to `distributed.shutdown`."""
        self.bar.close()
        for tracker in self.accelerator.trackers:
            tracker.finish()


def json_line(record: dict[str, float]) -> str:
    """One line of strict JSON: a non-finite value (which Python would write as NaN or Infinity, which
    JSON does not have) is written as null."""
    clean = {key: None if isinstance(v, float) and not math.isfinite(v) else v for key, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Trackers take flat scalar hyperparameters: {"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, int | float | str | bool) else str(value)
    return flat
