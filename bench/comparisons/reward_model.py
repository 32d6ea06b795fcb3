"""reward_model: reward-model pairs/s and peak RSS vs TRL RewardTrainer"""

from __future__ import annotations

import json

from common import MIB, SIZES, Bench, _medians, _row, _version

from comparisons.dpo import varied_pairs
from comparisons.post_training import finetune_measured, ratios, trl_measured

PEERS = {"finetune_ddp": "trl", "finetune_fsdp2": "trl"}
"""Each finetune engine against TRL's RewardTrainer (DDP, its only CPU engine)."""


def measure(bench: Bench) -> dict:
    """A reward model (Bradley-Terry, center_rewards_coefficient 0.01) against TRL's RewardTrainer (bench/
    trl_reward.py: DDP, chosen and rejected padded into one forward), 2 processes, same model, pairs (the DPO
    comparison's, of varied lengths) and micro-batch of 8 pairs, fp32 both: pairs/s, the peak resident memory of
    the largest process, and the rows' fill. finetune packs both sides of many pairs in a row, under DDP (TRL's
    engine) and FSDP2; a quick run (the test suite's) measures DDP against TRL."""
    size = SIZES["tiny" if bench.quick else "dpo"]
    model = bench.model(size)
    count, steps = (64, 4) if bench.quick else (160, 8)
    pairs = bench.work / f"pairs-{count}.jsonl"
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in varied_pairs(count)))
    settings = {
        "data.train_path": pairs, "data.format": "preference", "data.max_length": 256,
        "reward_model.center_rewards_coefficient": 0.01, "train.micro_batch_size": 8, "train.max_steps": steps,
        "optim.lr": "1e-5",
    }  # fmt: skip
    engines = {"finetune_ddp": "ddp.yaml"} | ({} if bench.quick else {"finetune_fsdp2": "fsdp2_full_shard.yaml"})
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, "trl"]}
    for repeat in range(bench.repeats):
        for name, config in engines.items():
            runs[name].append(finetune_measured(bench, f"rm-{name}-{repeat}", size, config, "pairs", **settings))
        result = bench.work / "runs" / f"rm-trl-{repeat}.json"
        runs["trl"].append(trl_measured("trl_reward.py", "pairs", result, str(model), str(pairs), str(steps), "8",
                                        "256", str(result)))  # fmt: skip
    median = _medians(runs)
    return {
        "size": size.name, "pairs": count, "runs": runs, "median": median, "ratios": ratios(median, PEERS, "pairs"),
        "targets": {"pairs_per_second": 1.5, "peak_rss": 1.0}, "trl_version": _version("trl"),
    }  # fmt: skip


def rows(rm: dict) -> list[str]:
    rows, median, targets = [], rm["median"], rm["targets"]
    for name, ratio in rm["ratios"].items():
        engine = "DDP both" if name == "finetune_ddp" else "FSDP2 vs DDP"
        ours, theirs = median[name], median[PEERS[name]]
        rows += [
            _row(f"reward model pairs/s vs TRL RewardTrainer {rm['trl_version']} ({rm['size']}, full, {engine})",
                 f"{ours['pairs_per_second']:.2f}", f"{theirs['pairs_per_second']:.2f}",
                 f"{ratio['pairs_per_second']:.2f}x", f">= {targets['pairs_per_second']}x"),
            _row(f"reward model peak RSS of the largest process ({engine})", f"{ours['peak_rss_bytes'] / MIB:.0f} MiB",
                 f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB", f"{ratio['peak_rss']:.2f}x",
                 f"<= {targets['peak_rss']}x"),
        ]  # fmt: skip
    ours, theirs = median["finetune_ddp"], median["trl"]
    rows.append(_row("reward model rows' fill, real tokens / token slots (finetune: packed; TRL: padded)",
                     f"{ours['fill']:.2f}", f"{theirs['fill']:.2f}"))  # fmt: skip
    return rows
