"""kto: KTO samples/s and peak RSS vs TRL KTOTrainer, its defaults and its best (precomputed reference)"""

from __future__ import annotations

import json

from common import MIB, SIZES, Bench, _medians, _row, _version

from comparisons.dpo import varied_pairs
from comparisons.post_training import finetune_measured, ratios, trl_measured

PEERS = {"finetune_ddp": "trl", "finetune_ddp@best": "trl_precomputed", "finetune_fsdp2": "trl"}
"""finetune (its reference precomputed: its default) against TRL's defaults (a reference model every step) and its
best (the reference precomputed too); the names after @ compare the same run with another peer."""


def unpaired(count: int) -> list[dict]:
    """The DPO comparison's pairs as KTO's unpaired samples: the chosen reply desirable, the rejected one not."""
    return [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in varied_pairs(count // 2)
        for side in ("chosen", "rejected")
    ]


def measure(bench: Bench) -> dict:
    """KTO (beta 0.1, weights 1) against TRL's KTOTrainer (bench/trl_kto.py: DDP, each micro-batch's samples and
    their mismatched partners padded), 2 processes, same model, samples (the DPO comparison's pairs made unpaired)
    and micro-batch of 8 samples, fp32 both: samples/s, the peak resident memory of the largest process, the rows'
    fill. finetune packs, its reference precomputed, under DDP and FSDP2; TRL with its defaults and with its
    reference precomputed. A quick run (the test suite's) measures DDP against TRL at its best."""
    size = SIZES["tiny" if bench.quick else "dpo"]
    model = bench.model(size)
    count, steps = (128, 4) if bench.quick else (320, 8)
    samples = bench.work / f"unpaired-{count}.jsonl"
    samples.write_text("".join(json.dumps(sample) + "\n" for sample in unpaired(count)))
    settings = {
        "data.train_path": samples, "data.format": "auto", "data.max_length": 256, "preference.loss": "kto",
        "preference.beta": 0.1, "train.micro_batch_size": 8, "train.max_steps": steps, "optim.lr": "1e-5",
    }  # fmt: skip
    engines = {"finetune_ddp": "ddp.yaml"} | ({} if bench.quick else {"finetune_fsdp2": "fsdp2_full_shard.yaml"})
    peers = {"trl_precomputed": "1"} | ({} if bench.quick else {"trl": "0"})
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, *peers]}
    for repeat in range(bench.repeats):
        for name, config in engines.items():
            runs[name].append(finetune_measured(bench, f"kto-{name}-{repeat}", size, config, "samples", **settings))
        for name, precompute in peers.items():
            result = bench.work / "runs" / f"kto-{name}-{repeat}.json"
            runs[name].append(trl_measured("trl_kto.py", "samples", result, str(model), str(samples), str(steps), "8",
                                           "256", str(result), precompute))  # fmt: skip
    median = _medians(runs)
    return {
        "size": size.name, "samples": count, "runs": runs, "median": median,
        "ratios": ratios(median, PEERS, "samples"), "targets": {"samples_per_second": 1.5, "peak_rss": 1.0},
        "trl_version": _version("trl"),
    }  # fmt: skip


def rows(kto: dict) -> list[str]:
    rows, median, targets = [], kto["median"], kto["targets"]
    setups = {"trl": "TRL's defaults: a reference model every step", "trl_precomputed": "reference precomputed both"}
    for name, ratio in kto["ratios"].items():
        engine = "DDP both" if name.startswith("finetune_ddp") else "FSDP2 vs DDP"
        peer = PEERS[name]
        ours, theirs = median[name.split("@")[0]], median[peer]
        rows += [
            _row(f"KTO samples/s vs TRL KTOTrainer {kto['trl_version']} ({kto['size']}, full, {engine}; "
                 f"{setups[peer]})", f"{ours['samples_per_second']:.2f}", f"{theirs['samples_per_second']:.2f}",
                 f"{ratio['samples_per_second']:.2f}x", f">= {targets['samples_per_second']}x"),
            _row(f"KTO peak RSS of the largest process ({engine}; {setups[peer]})",
                 f"{ours['peak_rss_bytes'] / MIB:.0f} MiB", f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB",
                 f"{ratio['peak_rss']:.2f}x", f"<= {targets['peak_rss']}x"),
        ]  # fmt: skip
    ours, theirs = median["finetune_ddp"], median["trl_precomputed"]
    rows.append(_row("KTO rows' fill, real tokens / token slots (finetune: packed; TRL: padded)",
                     f"{ours['fill']:.2f}", f"{theirs['fill']:.2f}"))  # fmt: skip
    return rows
