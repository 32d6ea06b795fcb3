"""dpo: DPO pairs/s and peak RSS vs TRL DPOTrainer, its defaults and its best (precomputed reference)"""

from __future__ import annotations

import json
import random

from common import LORA, MIB, SIZES, Bench, _medians, _row, _version

from comparisons import post_training
from comparisons.post_training import finetune_measured, trl_measured


def varied_pairs(count: int) -> list[dict]:
    """Demo-task pairs of varied lengths (reversals of 2 to 60 digits; the rejected reply swaps two neighbours), as
    preference data varies: what padding pays for and packing does not."""
    rng = random.Random(7)
    pairs = []
    for _ in range(count):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(2, 60))]
        reply = digits[::-1]
        wrong = list(reply)
        i = rng.randrange(len(wrong) - 1)
        wrong[i], wrong[i + 1] = wrong[i + 1], str((int(wrong[i]) + 1) % 10)
        pairs.append({
            "prompt": [{"role": "user", "content": "reverse: " + " ".join(digits)}],
            "chosen": [{"role": "assistant", "content": " ".join(reply)}],
            "rejected": [{"role": "assistant", "content": " ".join(wrong)}],
        })  # fmt: skip
    return pairs


def with_epoch(measured: dict, pairs: int) -> dict:
    """A run's figures and its epoch rate: its reference precompute pass (if any) counted in one epoch of `pairs`."""
    epoch = pairs / measured["pairs_per_second"]
    return measured | {
        "epoch_pairs_per_second": pairs / (epoch + measured["precompute_seconds"]),
        "precompute_fraction_of_epoch": measured["precompute_seconds"] / epoch,
    }


QUICK = ("finetune_full_ddp", "finetune_lora_ddp_precomputed", "trl_full", "trl_lora_precomputed")
"""What a quick run (the test suite's) measures: a reference model every step and a precomputed one, full and LoRA."""


def measure(bench: Bench) -> dict:
    """DPO (beta 0.1) against TRL's DPOTrainer (bench/trl_dpo.py: DDP, chosen and rejected padded into one
    forward) with its defaults (a reference model run every step) and at its best for the same work (its
    reference precomputed), 2 processes, same model, pairs and micro-batch of 8 pairs of varied lengths, fp32
    both: pairs/s, the peak resident memory of the largest process, and the rows' fill. finetune runs packed,
    its reference precomputed, under DDP (the same engine as TRL's) and FSDP2. LoRA on every linear layer:
    the policy with its adapters off as the reference, or (like with like against TRL's precompute) the
    reference precomputed. A precompute pass is counted both ways: pairs/s of the steps alone, and over one
    epoch of the same pairs with the pass's time added."""
    size = SIZES["tiny" if bench.quick else "dpo"]
    model = bench.model(size)
    count, steps = (64, 4) if bench.quick else (160, 8)
    pairs = bench.work / f"pairs-{count}.jsonl"
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in varied_pairs(count)))
    dpo = {
        "data.train_path": pairs, "data.format": "preference", "data.max_length": 256, "preference.loss": "dpo",
        "preference.beta": 0.1, "train.micro_batch_size": 8, "train.max_steps": steps, "optim.lr": "1e-5",
    }  # fmt: skip
    precomputed = {"preference.reference": "precomputed"}
    contenders = {
        "finetune_full_fsdp2": ("fsdp2_full_shard.yaml", {}), "finetune_full_ddp": ("ddp.yaml", {}),
        "finetune_lora_ddp": ("ddp.yaml", LORA), "finetune_lora_ddp_precomputed": ("ddp.yaml", LORA | precomputed),
    }  # fmt: skip
    peers = {"trl_full": (0, False), "trl_full_precomputed": (0, True), "trl_lora": (LORA["peft.r"], False),
             "trl_lora_precomputed": (LORA["peft.r"], True)}  # fmt: skip
    if bench.quick:  # the test suite's run: each kind of reference once, finetune's and TRL's
        contenders = {name: run for name, run in contenders.items() if name in QUICK}
        peers = {name: run for name, run in peers.items() if name in QUICK}
    runs: dict[str, list[dict]] = {name: [] for name in [*contenders, *peers]}
    for repeat in range(bench.repeats):
        for name, (config, settings) in contenders.items():
            curve = "finetune DPO (DDP)" if name == "finetune_full_ddp" else None
            measured = finetune_measured(bench, f"dpo-{name}-{repeat}", size, config, "pairs", curve, **dpo | settings)
            runs[name].append(with_epoch(measured, count))
        for name, (rank, precompute) in peers.items():
            result = bench.work / "runs" / f"{name}-{repeat}.json"
            measured = trl_measured("trl_dpo.py", "pairs", result, str(model), str(pairs), str(steps), "8", "256",
                                    str(rank), str(result), "1" if precompute else "0")  # fmt: skip
            runs[name].append(with_epoch(measured, count))
    median = _medians(runs)
    compared = {
        "finetune_full_ddp": "trl_full", "finetune_full_fsdp2": "trl_full", "finetune_lora_ddp": "trl_lora",
        "finetune_full_ddp@best": "trl_full_precomputed",
        "finetune_lora_ddp_precomputed": "trl_lora_precomputed",
    }  # fmt: skip
    compared = {
        name: peer for name, peer in compared.items() if name.removesuffix("@best") in median and peer in median
    }
    ratios = post_training.ratios(median, compared, "pairs")
    for name, peer in compared.items():  # and over one epoch, precompute passes counted
        ours, theirs = median[name.split("@")[0]], median[peer]
        ratios[name]["epoch_pairs_per_second"] = ours["epoch_pairs_per_second"] / theirs["epoch_pairs_per_second"]
    return {
        "size": size.name,
        "pairs": count,
        "runs": runs,
        "median": median,
        "ratios": ratios,
        "peers": compared,
        "targets": {"pairs_per_second": 1.5, "peak_rss": 0.7},
        "precompute_fraction_of_epoch": median["finetune_full_ddp"]["precompute_fraction_of_epoch"],
        "trl_version": _version("trl"),
    }


def rows(dpo: dict) -> list[str]:
    rows = []
    setups = {
        "finetune_full_ddp": "full, DDP both; TRL's defaults: a reference model every step",
        "finetune_full_fsdp2": "full, FSDP2 vs DDP; TRL's defaults: a reference model every step",
        "finetune_lora_ddp": "LoRA, DDP both; adapters off as the reference, both",
        "finetune_full_ddp@best": "full, DDP both; TRL at its best: reference precomputed, both",
        "finetune_lora_ddp_precomputed": "LoRA, DDP both; reference precomputed, both",
    }  # fmt: skip
    targets, median = dpo["targets"], dpo["median"]
    for name, setup in setups.items():
        if name not in dpo["peers"]:  # a quick run's
            continue
        peer = dpo["peers"][name]
        ours, theirs, ratios = median[name.removesuffix("@best")], median[peer], dpo["ratios"][name]
        rows += [
            _row(
                f"DPO pairs/s vs TRL DPOTrainer {dpo['trl_version']} ({dpo['size']}, {setup})",
                f"{ours['pairs_per_second']:.2f}", f"{theirs['pairs_per_second']:.2f}",
                f"{ratios['pairs_per_second']:.2f}x", f">= {targets['pairs_per_second']}x",
            ),
            _row(
                f"DPO peak RSS of the largest process ({setup.split(';')[0]}; {setup.split('; ')[1]})",
                f"{ours['peak_rss_bytes'] / MIB:.0f} MiB", f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB",
                f"{ratios['peak_rss']:.2f}x", f"<= {targets['peak_rss']}x",
            ),
        ]  # fmt: skip
        if ours["precompute_seconds"] or theirs["precompute_seconds"]:
            rows.append(
                _row(
                    f"DPO pairs/s over one epoch of {dpo['pairs']} pairs, precompute passes counted ({setup})",
                    f"{ours['epoch_pairs_per_second']:.2f}", f"{theirs['epoch_pairs_per_second']:.2f}",
                    f"{ratios['epoch_pairs_per_second']:.2f}x",
                )
            )  # fmt: skip
    ours, theirs = median["finetune_full_ddp"], median["trl_full"]
    rows.append(
        _row("DPO rows' fill, real tokens / token slots (finetune: packed; TRL: padded, full)",
             f"{ours['fill']:.2f}", f"{theirs['fill']:.2f}")
    )  # fmt: skip
    theirs = median.get("trl_full_precomputed")
    rows.append(
        _row(f"DPO reference precompute, fraction of one epoch of {dpo['pairs']} pairs (DDP, full)",
             f"{dpo['precompute_fraction_of_epoch']:.2f}",
             f"{theirs['precompute_fraction_of_epoch']:.2f} (precompute_ref_log_probs)" if theirs else "")
    )  # fmt: skip
    return rows
