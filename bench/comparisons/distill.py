"""distill: distillation target tokens/s (off-policy) and samples/s (on-policy) and peak RSS vs TRL GKDTrainer"""

from __future__ import annotations

import json
import re
import shutil
import sys

from common import (
    ENV,
    MIB,
    REPO,
    Bench,
    Size,
    _free_port,
    _medians,
    _row,
    _steady_rate,
    _timed_peak_rss,
    _version,
)

DISTILL_RECIPE = REPO / "recipes" / "demo" / "tiny_llama_distill.yaml"

# A teacher and a student of half its width and depth, with a real model's vocabulary (32,000): the divergence is
# over the whole vocabulary at every trained token, for both models, and the logits are what it costs.
TEACHER = Size("distill-teacher", 512, 8, 2048, 8, vocab=32000)
STUDENT = Size("distill-student", 256, 4, 1024, 4, vocab=32000)
QUICK_TEACHER, QUICK_STUDENT = Size("tiny", 128, 4, 384, 4), Size("tinier", 64, 2, 192, 2)
TOP_K = 32


def measure(bench: Bench) -> dict:
    """Distillation against TRL's GKDTrainer (bench/trl_gkd.py), 2 processes, the same randomly initialised
    teacher and student (half its width and depth), the demo's chat data, GKD's generalized JSD (beta 0.5) at
    temperature 1, fp32 both. Off-policy (the data's replies, TRL's lmbda 0): target tokens/s (finetune packs
    rows, one of 128 tokens a micro-batch, about TRL's 8 padded conversations; the trained tokens are the same).
    On-policy (the student's own completions of 48 new tokens, lmbda 1): samples/s with a sample per row on both
    sides (finetune unpacked). finetune under DDP (TRL's engine) and FSDP2; TRL with gradient checkpointing off
    and on, the faster compared; beside each rate, the peak resident memory of the largest process."""
    teacher = bench.model(QUICK_TEACHER if bench.quick else TEACHER)
    student = bench.model(QUICK_STUDENT if bench.quick else STUDENT)
    steps, new_tokens = (3, 8) if bench.quick else (10, 48)
    common = {
        "distill.teacher": teacher, "distill.divergence": "jsd", "distill.beta": 0.5, "distill.temperature": 1.0,
        "data.max_length": 128, "train.micro_batch_size": 8, "train.max_steps": steps, "eval.generate": "null",
    }  # fmt: skip
    # Off-policy, one packed row of 128 tokens a micro-batch: about the 8 conversations of TRL's padded micro-batch,
    # so that the step's memory compares like with like (the rate is of the trained tokens either way).
    off = {"distill.on_policy_fraction": 0, "distill.max_new_tokens": "null", "train.micro_batch_size": 1}
    on = {"distill.on_policy_fraction": 1, "distill.max_new_tokens": new_tokens, "data.packing": "false"}
    # The teacher's top 32 tokens precomputed once (distill.teacher_top_k): no teacher while training; the table's
    # computation is timed apart (it serves every later run on the same teacher and data).
    table = off | {"distill.teacher_top_k": TOP_K}
    contenders = {
        "off_finetune_ddp": ("ddp.yaml", off), "off_finetune_fsdp2": ("fsdp2_full_shard.yaml", off),
        "off_finetune_ddp_table": ("ddp.yaml", table),
        "on_finetune_ddp": ("ddp.yaml", on), "on_finetune_fsdp2": ("fsdp2_full_shard.yaml", on),
    }  # fmt: skip
    peers = {"off_trl": (0.0, False), "off_trl_gc": (0.0, True), "on_trl": (1.0, False), "on_trl_gc": (1.0, True)}
    if bench.quick:  # the test suite's run: finetune's table and on-policy kinds, TRL's off-policy run (its script)
        contenders = {name: contenders[name] for name in ("off_finetune_ddp_table", "on_finetune_fsdp2")}
        peers = {"off_trl": (0.0, False)}
    size = QUICK_STUDENT if bench.quick else STUDENT
    runs: dict[str, list[dict]] = {name: [] for name in [*contenders, *peers]}
    for repeat in range(bench.repeats):
        for name, (config, settings) in contenders.items():
            command, out = bench.finetune_command(
                f"distill-{name}-{repeat}", size, config, recipe=DISTILL_RECIPE, **(common | settings)
            )
            log = bench.work / "runs" / f"distill-{name}-{repeat}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            # A table run has a cache of its own, emptied: each computes its table (none reads another's).
            cache = {"HF_DATASETS_CACHE": str(bench.work / "runs" / f"distill-{name}-{repeat}-cache")}
            shutil.rmtree(cache["HF_DATASETS_CACHE"], ignore_errors=True)
            _, peak = _timed_peak_rss(
                command, stdout=log, env=ENV | cache if "distill.teacher_top_k" in settings else None
            )
            said = re.search(r"computed in ([0-9.]+) s", log.read_text())
            entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps_of = [e for e in entries if "loss" in e]
            seconds = [e["step_seconds"] for e in steps_of]
            # Off-policy: the target tokens trained; on-policy: the rows, a prompt each (8 a process, 2 processes).
            counts = [e["target_tokens"] for e in steps_of] if name.startswith("off") else [16] * len(seconds)
            runs[name].append({"rate": _steady_rate(counts, seconds), "peak_rss_bytes": peak}
                              | ({"table_seconds": float(said[1])} if said else {}))  # fmt: skip
            if name == "off_finetune_ddp":
                bench.curves.setdefault("finetune distillation, off-policy (DDP)", [e["loss"] for e in steps_of])
        for name, (lmbda, checkpointing) in peers.items():
            result = bench.work / "runs" / f"distill-{name}-{repeat}.json"
            _, peak = _timed_peak_rss([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "trl_gkd.py"), str(student), str(teacher), str(bench.data),
                str(steps), "8", "128", str(lmbda), str(new_tokens), "1" if checkpointing else "0", str(result),
            ])  # fmt: skip
            trl = json.loads(result.read_text())
            counts = trl["target_tokens"] if name.startswith("off") else trl["samples"]
            runs[name].append({"rate": _steady_rate(counts, trl["step_seconds"]), "peak_rss_bytes": peak})
    median = _medians(runs)
    # TRL at its best: the faster of gradient checkpointing off and on, for each kind.
    best = {
        kind: max((name for name in peers if name.startswith(kind)), key=lambda name: median[name]["rate"])
        for kind in ("off", "on") if any(name.startswith(kind) for name in peers)
    }  # fmt: skip
    ratios = {}
    for name in (name for name in contenders if name.split("_")[0] in best):
        ours, theirs = median[name], median[best[name.split("_")[0]]]
        ratios[name] = {key: ours[key] / theirs[key] for key in ("rate", "peak_rss_bytes")}
    return {
        "top_k": TOP_K,
        "teacher": (QUICK_TEACHER if bench.quick else TEACHER).name, "student": size.name, "new_tokens": new_tokens,
        "runs": runs, "median": median, "best_trl": best, "ratios": ratios,
        "targets": {"rate": 1.5, "peak_rss": 1.0}, "trl_version": _version("trl"),
    }  # fmt: skip


def rows(distill: dict) -> list[str]:
    setups = {
        "off_finetune_ddp": ("off", "target tokens/s", "off-policy, DDP both"),
        "off_finetune_fsdp2": ("off", "target tokens/s", "off-policy, FSDP2 vs DDP"),
        "off_finetune_ddp_table": ("off", "target tokens/s", f"off-policy, teacher's top {distill.get('top_k')} "
                                   "precomputed, DDP both"),
        "on_finetune_ddp": ("on", "samples/s", f"on-policy, {distill['new_tokens']} new tokens, DDP both"),
        "on_finetune_fsdp2": ("on", "samples/s", f"on-policy, {distill['new_tokens']} new tokens, FSDP2 vs DDP"),
    }  # fmt: skip
    median, targets, rows = distill["median"], distill["targets"], []
    for name, (kind, unit, setup) in setups.items():
        if name not in distill["ratios"]:  # a quick run's
            continue
        peer = distill["best_trl"][kind]
        ours, theirs, ratio = median[name], median[peer], distill["ratios"][name]
        checkpointing = "with" if peer.endswith("_gc") else "without"
        where = f"{distill['student']} from {distill['teacher']}, {setup}; TRL {checkpointing} gradient checkpointing"
        rows += [
            _row(f"distillation {unit} vs TRL GKDTrainer {distill['trl_version']} ({where})",
                 f"{ours['rate']:.1f}", f"{theirs['rate']:.1f}", f"{ratio['rate']:.2f}x", f">= {targets['rate']}x"),
            _row(f"distillation peak RSS of the largest process ({setup})", f"{ours['peak_rss_bytes'] / MIB:.0f} MiB",
                 f"{theirs['peak_rss_bytes'] / MIB:.0f} MiB", f"{ratio['peak_rss_bytes']:.2f}x",
                 f"<= {targets['peak_rss']}x"),
        ]  # fmt: skip
        if "table_seconds" in ours:
            rows.append(
                _row(
                    f"distillation: the teacher's top-{distill['top_k']} table computed once, seconds "
                    "(every row of the data; reused by later runs)",
                    f"{ours['table_seconds']:.1f}",
                    "",
                )
            )
    return rows
