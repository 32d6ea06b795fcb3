"""What the DPO, reward-model and KTO comparisons share (not a comparison itself): one finetune run and one TRL peer
script measured alike, in units (pairs, samples) a second of the steady steps, the peak resident memory of the
largest process, the rows' fill, and the seconds of a reference precompute pass."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from common import ENV, REPO, Bench, Size, _free_port, _steady_rate, _timed_peak_rss


def finetune_measured(
    bench: Bench, name: str, size: Size, config: str, unit: str, curve: str | None = None, **settings
) -> dict:
    """One finetune launch of 2 processes with `settings`, measured; `unit` is the metrics' count of a step. Its loss
    curve is plotted under the label `curve`, if given (the first run of that label)."""
    command, out = bench.finetune_command(name, size, config, **settings)
    log = bench.work / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # A cache of its own: every run tokenizes (and precomputes its reference), none reads another's.
    _, peak = _timed_peak_rss(command, stdout=log, env=ENV | {"HF_DATASETS_CACHE": str(log.with_suffix(".cache"))})
    steps = [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in e]
    if curve:
        bench.curves.setdefault(curve, [e["loss"] for e in steps])
    said = re.search(r"precomputed with the initial weights in ([0-9.]+) s", log.read_text())
    return {
        f"{unit}_per_second": _steady_rate([e[unit] for e in steps], [e["step_seconds"] for e in steps]),
        "peak_rss_bytes": peak, "fill": statistics.median(e["fill"] for e in steps),
        "precompute_seconds": float(said[1]) if said else 0.0,
    }  # fmt: skip


def trl_measured(script: str, unit: str, result: Path, *arguments: str) -> dict:
    """One TRL peer script on 2 processes (torchrun, DDP), measured as `finetune_measured`; it writes `result`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(REPO / "bench" / script), *arguments]  # fmt: skip
    _, peak = _timed_peak_rss(command)
    trl = json.loads(result.read_text())
    return {
        f"{unit}_per_second": _steady_rate(trl[unit], trl["step_seconds"]), "peak_rss_bytes": peak,
        "fill": sum(trl["tokens"]) / sum(trl["slots"]), "precompute_seconds": trl.get("precompute_seconds", 0.0),
    }  # fmt: skip


def ratios(median: dict[str, dict], peers: dict[str, str], unit: str) -> dict[str, dict]:
    """finetune's rate and peak memory over its peer's, for each pair of `peers` that ran (finetune's name may end in
    @ and a tag: the same run compared with a second peer)."""
    measured = {}
    for name, peer in peers.items():
        ours, theirs = median.get(name.split("@")[0]), median.get(peer)
        if ours and theirs:
            measured[name] = {
                f"{unit}_per_second": ours[f"{unit}_per_second"] / theirs[f"{unit}_per_second"],
                "peak_rss": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
            }
    return measured
