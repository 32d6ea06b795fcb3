"""reward_model: reward-model pairs/s and peak RSS vs TRL RewardTrainer"""

from __future__ import annotations

import json

from common import MIB, SIZES, Bench, _medians, _row, _version

from comparisons.dpo import varied_pairs
from comparisons.post_training import finetune_measured, ratios, trl_measured

PEERS = {"finetune_ddp": "trl_no_recompute", "finetune_ddp_recompute": "trl", "finetune_fsdp2": "trl_no_recompute"}
"""Like against like: finetune keeping every activation against TRL with gradient checkpointing off, and finetune with
activation checkpointing (full) against TRL's default (gradient checkpointing on); DDP both, or FSDP2 against TRL's
DDP (its only CPU engine)."""
RECOMPUTE = {"train.activation_checkpointing": "full"}


def measure(bench: Bench) -> dict:
    """A reward model (Bradley-Terry, center_rewards_coefficient 0.01) against TRL's RewardTrainer (bench/
    trl_reward.py: DDP, chosen and rejected padded into one forward), 2 processes, same model, pairs (the DPO
    comparison's, of varied lengths) and micro-batch of 8 pairs, fp32 both: pairs/s, the peak resident memory of
    the largest process, and the rows' fill. finetune packs both sides of many pairs in a row, under DDP (TRL's
    engine) and FSDP2. Each side with and without recomputing activations in backward (`PEERS`): TRL's default
    recomputes, which a comparison of memory against finetune's default (it does not) would credit to the trainer
    rather than the setting. A quick run (the test suite's) measures DDP against TRL, neither recomputing."""
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
    engines = {"finetune_ddp": ("ddp.yaml", {})}
    peers = {"trl_no_recompute": "0"}
    if not bench.quick:
        engines |= {"finetune_ddp_recompute": ("ddp.yaml", RECOMPUTE), "finetune_fsdp2": ("fsdp2_full_shard.yaml", {})}
        peers |= {"trl": "1"}
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, *peers]}
    for repeat in range(bench.repeats):
        for name, (config, recompute) in engines.items():
            run = finetune_measured(bench, f"rm-{name}-{repeat}", size, config, "pairs", **settings | recompute)
            runs[name].append(run)
        for name, recompute in peers.items():
            result = bench.work / "runs" / f"rm-{name}-{repeat}.json"
            runs[name].append(trl_measured("trl_reward.py", "pairs", result, str(model), str(pairs), str(steps), "8",
                                           "256", str(result), recompute))  # fmt: skip
    median = _medians(runs)
    return {
        "size": size.name, "pairs": count, "runs": runs, "median": median, "ratios": ratios(median, PEERS, "pairs"),
        "targets": {"pairs_per_second": 1.5, "peak_rss": 1.0}, "trl_version": _version("trl"),
    }  # fmt: skip


def rows(rm: dict) -> list[str]:
    rows, median, targets = [], rm["median"], rm["targets"]
    setups = {"finetune_ddp": "DDP both, neither recomputing", "finetune_fsdp2": "FSDP2 vs DDP, neither recomputing",
              "finetune_ddp_recompute": "DDP both, both recomputing (TRL's default)"}  # fmt: skip
    for name, ratio in rm["ratios"].items():
        engine = setups[name]
        ours, theirs = median[name], median[PEERS[name]]
        rows += [
            _row(f"reward model pairs/s vs TRL RewardTrainer {rm['trl_version']} ({rm['size']}, full, {engine})",
                 f"{ours['pairs_per_second']:.2f}", f"{theirs['pairs_per_second']:.2f}",
                 f"{ratio['pairs_per_second']:.2f}x", f">= {targets['pairs_per_second']}x"),
            _row(f"reward model peak RSS of the largest process ({engine})", f"{ours['peak_rss_bytes'] / MIB:.0f} MiB",
                 f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB", f"{ratio['peak_rss']:.2f}x",
                 f"<= {targets['peak_rss']}x"),
        ]  # fmt: skip
    ours, theirs = median["finetune_ddp"], median["trl_no_recompute"]
    rows.append(_row("reward model rows' fill, real tokens / token slots (finetune: packed; TRL: padded)",
                     f"{ours['fill']:.2f}", f"{theirs['fill']:.2f}"))  # fmt: skip
    return rows
