"""`make bench`: finetune's speed and memory against its peers, as ratios measured in one run.

    python bench/run.py [--quick] [--repeats 3] [--out bench/results]

Machines are shared and noisy, so nothing here is an absolute claim: each comparison runs its
contenders interleaved (A, B, A, B, ...) `--repeats` times on the same machine and reports the
median of each and their ratio. Results go to bench/results/<date>-<commit>.json, a markdown
table next to it, and PNG plots of loss and memory. `--quick` runs everything once on tiny sizes:
what the test suite runs to prove the scripts work (it asserts no timing).

Comparisons (2 CPU processes over gloo unless stated), one module each in bench/comparisons/ (`measure`, `rows`):
  loop_overhead    finetune's loop vs a hand-written FSDP2 loop (bench/handwritten_fsdp2.py): steps/s
  trainer          target tokens/s of finetune (DDP and FSDP2) vs transformers.Trainer and TRL SFTTrainer (DDP)
  export           `finetune export` vs `accelerate merge-weights` on one SHARDED checkpoint: time, peak RSS
  checkpoint_save  seconds the loop is blocked by a save: SHARDED (synchronous, asynchronous) vs FULL state dict
  scaling          step time and per-rank memory: 3 sizes x 1/2 processes x full shard/shard-grad-op/DDP
  data_pipeline    tokenize + mask vs a batched render + tokenize datasets.map; + pack, first and cached
  loss_path        train.loss_path chunked vs full_logits: step peak, bytes saved for backward, tokens/s
  lora_vs_full     LoRA vs full fine-tuning (FSDP2): step time, rank 0 memory, checkpoint bytes
  trl_lora         target tokens/s of finetune LoRA vs TRL's SFTTrainer + PEFT (packing, padding-free), DDP
  dpo              DPO pairs/s and peak RSS vs TRL DPOTrainer, its defaults and its best (precomputed reference)
  moe              a mixture of experts (Qwen3-MoE, top 2 of 8): grouped_mm experts vs the per-expert loop and vs TRL
  merge            `finetune export --merge` vs PEFT's merge_and_unload() + save_pretrained: time, peak RSS
  grpo             online RL prompts/s through whole steps (generation included) and peak RSS vs TRL GRPOTrainer
  distill          distillation target tokens/s (off-policy), samples/s (on-policy) and peak RSS vs TRL GKDTrainer
  agent            online RL over episodes that call a tool: episodes/s and peak RSS vs TRL GRPOTrainer with tools
  reward_model     reward-model pairs/s and peak RSS vs TRL RewardTrainer (DDP), finetune packed under DDP and FSDP2
  kto              KTO samples/s and peak RSS vs TRL KTOTrainer, its defaults and its best (precomputed reference)
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import time
from pathlib import Path

from common import REPO, Bench, _git

SECTIONS = ("data_pipeline", "packing", "loss_path", "loop_overhead", "trainer", "checkpoint_save", "scaling",
            "export", "lora_vs_full", "trl_lora", "dpo", "moe", "merge", "long_context", "grpo",
            "distill", "agent", "reward_model", "kto")  # fmt: skip
"""Every comparison, in the order `make bench` runs them: each a module of bench/comparisons/."""
TABLE = ("loop_overhead", "trainer", "export", "checkpoint_save", "data_pipeline", "packing", "loss_path",
         "lora_vs_full", "trl_lora", "dpo", "moe", "merge", "long_context", "grpo", "distill", "agent",
         "reward_model", "kto")  # fmt: skip
"""The comparison table's rows, in the table's order (scaling has a table of its own)."""
COMPARISONS = {name: importlib.import_module(f"comparisons.{name}") for name in SECTIONS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (the test suite's run)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per contender")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for the results")
    parser.add_argument("--work", default=str(REPO / "outputs" / "bench"), help="scratch folder (models, runs)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated comparisons to run, of: {', '.join(SECTIONS)}"
    )
    args = parser.parse_args()
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown or not only:
        parser.error(f"--only takes comparisons of: {', '.join(SECTIONS)} (got {args.only!r})")
    partial = set(only) != set(SECTIONS)
    bench = Bench(Path(args.work), quick=args.quick, repeats=1 if args.quick else args.repeats)
    started = time.perf_counter()
    results = {
        "date": datetime.date.today().isoformat(),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "quick": args.quick,
        "repeats": bench.repeats,
    }
    for name in (name for name in SECTIONS if name in only):
        print(f"bench: {name} ...", flush=True)
        began = time.perf_counter()
        results[name] = COMPARISONS[name].measure(bench)
        print(f"bench: {name} done in {time.perf_counter() - began:.0f} s", flush=True)
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A partial run is named by what it ran, so that it never passes for (or overwrites) a whole one.
    stem = out / "-".join(
        [results["date"], results["commit"], *(["quick"] if args.quick else []), *(sorted(only) if partial else [])]
    )
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(results))
    plot(bench.curves, results, stem)
    print(markdown(results))
    print(f"bench: wrote {stem}.json, .md and the plots of what ran in {results['total_seconds']:.0f} s")


# ---- reports ---------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    """The results as the tables docs/benchmarks.md quotes: the rows of each comparison that ran."""
    lines = [
        f"# Benchmarks {results['date']} ({results['commit']}), {results['machine']['cpus']} CPUs, "
        f"median of {results['repeats']} interleaved repetitions{' (quick)' if results['quick'] else ''}",
        "",
        "| comparison | finetune | peer | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for name in TABLE:
        if name in results:
            lines += COMPARISONS[name].rows(results[name])
    if "scaling" in results:
        lines += ["", *COMPARISONS["scaling"].rows(results["scaling"])]
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[float]], results: dict, stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if curves:
        figure, axis = plt.subplots(figsize=(6, 4))
        for label, losses in curves.items():
            axis.plot(range(1, len(losses) + 1), losses, label=label)
        axis.set(xlabel="step", ylabel="training loss", title="Same model, data and optimizer")
        axis.legend()
        figure.tight_layout()
        figure.savefig(f"{stem}-loss.png", dpi=120)
        plt.close(figure)
    if "scaling" not in results:
        return
    rows = [r for r in results["scaling"]["rows"] if r["processes"] == 2]
    figure, axis = plt.subplots(figsize=(7, 4))
    labels = [f"{r['size']}\n{r['strategy']}" for r in rows]
    bottom = [0.0] * len(rows)
    for field in ("parameters", "gradients", "optimizer_state", "activations"):
        values = [r["rank0_bytes"].get(field, 0) / 2**20 for r in rows]
        axis.bar(labels, values, bottom=bottom, label=field)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set(ylabel="MiB on rank 0", title="Per-rank memory, 2 processes")
    axis.legend()
    figure.tight_layout()
    figure.savefig(f"{stem}-memory.png", dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
