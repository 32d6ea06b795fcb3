"""`make bench`: finetune's speed and memory against its peers, as ratios measured in one run.

    python bench/run.py [--quick] [--repeats 3] [--out bench/results]

Machines are shared and noisy, so nothing here is an absolute claim: each comparison runs its
contenders interleaved (A, B, A, B, ...) `--repeats` times on the same machine and reports the
median of each and their ratio. Results go to bench/results/<date>-<commit>.json, a markdown
table next to it, and PNG plots of loss and memory. `--quick` runs everything once on tiny sizes:
what the test suite runs to prove the scripts work (it asserts no timing).

Comparisons (2 CPU processes over gloo unless stated):
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
  merge            `finetune export --merge` vs PEFT's merge_and_unload() + save_pretrained: time, peak RSS
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "accelerate_configs"
RECIPE = REPO / "recipes" / "demo" / "tiny_llama.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Size:
    """A Llama shape for the benchmarks; the vocabulary is padded past the demo tokenizer's."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int = 384


SIZES = {
    "tiny": Size("tiny", 128, 4, 384, 4),
    "small": Size("small", 256, 6, 768, 8),
    "medium": Size("medium", 512, 8, 1536, 8),
    # 66M parameters with a real model's vocabulary (32,000, Llama-2's and Mistral's): weights, gradients and
    # optimizer states (and TRL's reference) outweigh the libraries, and the logits over the vocabulary, the largest
    # activation of preference tuning (chosen and rejected, policy and reference), are what they are in practice.
    "dpo": Size("dpo", 512, 8, 2048, 8, vocab=32000),
    # Several hundred million parameters, for the export comparison only (never trained beyond one step).
    "export": Size("export", 1024, 24, 2816, 16, vocab=32000),
}


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
        results[name] = getattr(bench, name)()
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


class Bench:
    def __init__(self, work: Path, quick: bool, repeats: int):
        self.work, self.quick, self.repeats = work, quick, repeats
        self.curves: dict[str, list[float]] = {}  # loss curves to plot
        work.mkdir(parents=True, exist_ok=True)
        from finetune import demo

        demo.build(str(work / "demo"))  # tokenizer and chat data (offline)
        self.data = work / "demo" / "data" / "train.jsonl"
        self.steps = 6 if quick else 30
        self.train_size = SIZES["tiny" if quick else "small"]

    # ---- assets -------------------------------------------------------------------------------

    def model(self, size: Size, experts: int = 0) -> Path:
        """A randomly initialised Llama of `size`, or with `experts` a Qwen3-MoE of its width and depth with that
        many experts of a quarter of its MLP width, 2 per token; saved once with the demo tokenizer."""
        folder = self.work / "models" / (f"{size.name}-moe" if experts else size.name)
        if (folder / "config.json").exists():
            return folder
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.work / "demo" / "base")
        torch.manual_seed(0)
        shape = dict(
            vocab_size=max(size.vocab, len(tokenizer)), hidden_size=size.hidden, intermediate_size=size.intermediate,
            num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
            max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        if experts:
            moe = dict(moe_intermediate_size=size.intermediate // 4, num_experts=experts, num_experts_per_tok=2)
            config = AutoConfig.for_model("qwen3_moe", **shape, **moe, head_dim=size.hidden // size.heads)
        else:
            config = AutoConfig.for_model("llama", **shape)
        partial = folder.with_suffix(".partial")
        AutoModelForCausalLM.from_config(config).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(folder)
        return folder

    def finetune_run(self, name: str, size: Size, config: str, processes: int = 2, **overrides) -> dict:
        """One `accelerate launch -m finetune train` of the demo recipe on the bench model; its metrics."""
        command, out = self.finetune_command(name, size, config, processes, **overrides)
        _run(command)
        return _metrics(out / "metrics.jsonl")

    def finetune_command(
        self, name: str, size: Size, config: str, processes: int = 2, **overrides
    ) -> tuple[list[str], Path]:
        """The launch of `finetune_run`, and the output folder it writes."""
        out = self.work / "runs" / name
        values = {
            "model.name_or_path": self.model(size),
            "data.train_path": self.data,
            "data.eval_path": "null",
            "output.dir": out,
            "output.overwrite": "true",
            "output.trackers": "[]",
            "output.export": "false",
            "train.max_steps": self.steps,
            "train.log_every_steps": 1,
            "train.eval_every_steps": 0,
            "optim.lr": "1e-4",
            "optim.warmup_steps": 0,
            "optim.schedule": "constant",
            **overrides,
        }
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
            "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", str(_free_port()),
            "-m", "finetune", "train", str(RECIPE), *[f"{k}={v}" for k, v in values.items()],
        ]  # fmt: skip
        return command, out

    # ---- comparisons --------------------------------------------------------------------------

    def loop_overhead(self) -> dict:
        """finetune vs the hand-written FSDP2 loop on the same packed rows: median steps/s, interleaved."""
        from finetune.config import DataConfig
        from finetune.data import load_split, prepare_split

        size = self.train_size
        model = self.model(size)
        import torch
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        cfg = DataConfig(train_path=str(self.data), max_length=128, format="chat", packing=True)
        rows, _ = prepare_split(load_split(cfg.train_path, "train"), tokenizer, cfg, seed=42)
        rows_path = self.work / "packed_rows.pt"
        torch.save({key: torch.tensor(rows[key]) for key in ("input_ids", "position_ids", "target_ids")}, rows_path)
        ours, theirs = [], []
        for repeat in range(self.repeats):
            metrics = self.finetune_run(f"loop-{repeat}", size, "fsdp2_full_shard.yaml")
            ours.append(1 / _steady_median(metrics["step_seconds"]))
            self.curves.setdefault("finetune (FSDP2)", metrics["loss"])
            out = self.work / "runs" / f"handwritten-{repeat}.json"
            _run([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "handwritten_fsdp2.py"), str(model), str(rows_path),
                str(self.steps), "8", str(out),
            ])  # fmt: skip
            handwritten = json.loads(out.read_text())
            theirs.append(1 / _steady_median(handwritten["step_seconds"]))
            self.curves.setdefault("hand-written FSDP2", handwritten["loss"])
        return _ratio("steps_per_second", "finetune", ours, "handwritten_fsdp2", theirs, target=0.97, size=size)

    def trainer(self) -> dict:
        """Target tokens/s on variable-length chat samples: finetune (packed) vs Trainer (padded) and vs
        TRL's SFTTrainer (packed, padding-free; bench/trl_sft.py with every weight trained)."""
        size = self.train_size
        model = self.model(size)
        results: dict[str, list[float]] = {
            "finetune_ddp": [],
            "finetune_fsdp2": [],
            "trainer_ddp": [],
            "trl_sft_ddp": [],
        }
        for repeat in range(self.repeats):
            for name, config in (("finetune_ddp", "ddp.yaml"), ("finetune_fsdp2", "fsdp2_full_shard.yaml")):
                metrics = self.finetune_run(f"{name}-{repeat}", size, config)
                results[name].append(_steady_rate(metrics["target_tokens"], metrics["step_seconds"]))
            out = self.work / "runs" / f"trainer-{repeat}.json"
            _run([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "trainer_ddp.py"), str(model), str(self.data),
                str(self.steps), "8", str(out),
            ])  # fmt: skip
            trainer = json.loads(out.read_text())
            results["trainer_ddp"].append(_steady_rate(trainer["target_tokens"], trainer["step_seconds"]))
            out = self.work / "runs" / f"trl-full-{repeat}.json"
            _run([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "trl_sft.py"), str(model), str(self.data), str(self.steps),
                "8", "128", "0", str(out),
            ])  # fmt: skip
            trl = json.loads(out.read_text())
            results["trl_sft_ddp"].append(_steady_rate(trl["target_tokens"], trl["step_seconds"]))
        medians = {name: statistics.median(values) for name, values in results.items()}
        return {
            "metric": "target_tokens_per_second",
            "size": size.name,
            "runs": results,
            "median": medians,
            "ratio_ddp": medians["finetune_ddp"] / medians["trainer_ddp"],
            "ratio_fsdp2": medians["finetune_fsdp2"] / medians["trainer_ddp"],
            "target": 1.3,
            "ratio_trl_ddp": medians["finetune_ddp"] / medians["trl_sft_ddp"],
            "trl_version": _version("trl"),
            "target_trl": 1.1,
        }

    def checkpoint_save(self) -> dict:
        """Seconds the loop is blocked by one save: SHARDED (DCP) synchronous and asynchronous
        (checkpoint.async_save: blocked while the state is copied to host memory, and while a previous save
        still writes), and FULL state dict."""
        size = SIZES["tiny" if self.quick else "medium"]
        contenders = {
            "sharded": ("fsdp2_full_shard.yaml", {}),
            "sharded_async": ("fsdp2_full_shard.yaml", {"checkpoint.async_save": "true"}),
            "full": ("fsdp2_shard_grad_op.yaml", {}),
        }
        results: dict[str, list[float]] = {name: [] for name in contenders}
        for repeat in range(self.repeats):
            for name, (config, extra) in contenders.items():
                settings = {"train.max_steps": 6, "checkpoint.save_every_steps": 2, **extra}
                metrics = self.finetune_run(f"save-{name}-{repeat}", size, config, **settings)
                results[name].extend(metrics["checkpoint_seconds"])
        median = {name: statistics.median(values) for name, values in results.items()}
        return {
            "metric": "seconds_blocked_per_save",
            "size": size.name,
            "runs": results,
            "median": median,
            "async_over_sync": median["sharded_async"] / median["sharded"],
            "target_async_over_sync": 0.3,
        }

    def scaling(self) -> dict:
        """Step time and per-rank memory across sizes, process counts and strategies."""
        sizes = ["tiny"] if self.quick else ["tiny", "small", "medium"]
        strategies = {
            "full_shard": "fsdp2_full_shard.yaml",
            "shard_grad_op": "fsdp2_shard_grad_op.yaml",
            "ddp": "ddp.yaml",
        }
        rows = []
        for size_name in sizes:
            for processes in (1, 2):
                for strategy, config in strategies.items():
                    metrics = self.finetune_run(
                        f"scale-{size_name}-{processes}-{strategy}", SIZES[size_name], config, processes,
                        **{"train.max_steps": min(self.steps, 10), "train.micro_batch_size": 16 // processes},
                    )  # fmt: skip
                    memory = {key.split("/")[-1]: value for key, value in metrics["memory"].items()}
                    rows.append({
                        "size": size_name, "parameters": _parameters(self.model(SIZES[size_name])),
                        "processes": processes,
                        "strategy": strategy if processes > 1 or strategy != "ddp" else "single",
                        "step_seconds": _steady_median(metrics["step_seconds"]),
                        "rank0_bytes": memory,
                    })  # fmt: skip
        return {"global_batch_rows": 16, "rows": rows}

    def data_pipeline(self) -> dict:
        """finetune's tokenization with assistant-only masking vs a batched `datasets.map` that only renders the
        chat template and tokenizes, on the demo's short chats and on long multi-turn chats made of them (medians
        of repetitions interleaved A, B, B, A, ..., nothing cached, each kept in the results); and tokenize + mask +
        pack, the first time and cached."""
        import datasets
        from transformers import AutoTokenizer

        from finetune.config import DataConfig
        from finetune.data import prepare_split
        from finetune.data.tokenize import tokenize

        tokenizer = AutoTokenizer.from_pretrained(self.work / "demo" / "base")
        cache = self.work / "datasets-cache"
        shutil.rmtree(cache, ignore_errors=True)
        short = datasets.load_dataset("json", data_files=str(self.data), split="train", cache_dir=str(cache))
        if self.quick:
            short = short.select(range(500))
        long = datasets.Dataset.from_list(long_chats(list(short["messages"]), len(short) // 10))
        cfg = DataConfig(train_path=str(self.data), max_length=1 << 16, format="chat", packing=True)

        def plain(data: datasets.Dataset) -> datasets.Dataset:
            return data.map(
                lambda batch: tokenizer(tokenizer.apply_chat_template(batch["messages"], tokenize=False)),
                batched=True, remove_columns=data.column_names,
            )  # fmt: skip

        contenders = {
            "finetune_tokenize_mask": lambda data: tokenize(data, tokenizer, cfg),
            "plain_batched_map": plain,
        }
        sets: dict[str, dict] = {}
        datasets.disable_caching()  # every repetition computes
        try:
            for name, data in (("short", short), ("long", long)):
                seconds: dict[str, list[float]] = {contender: [] for contender in contenders}
                for repeat in range(3 * self.repeats):  # seconds each: more repetitions against the noise
                    # A, B then B, A: whatever running second (or first) costs falls on both alike.
                    order = list(contenders.items())[:: 1 if repeat % 2 == 0 else -1]
                    for contender, run in order:
                        gc.collect()  # as timeit does: the collector's pauses otherwise fall on either contender
                        gc.disable()
                        try:
                            began = time.perf_counter()
                            out = run(data)
                            seconds[contender].append(time.perf_counter() - began)
                        finally:
                            gc.enable()
                median = {contender: statistics.median(values) for contender, values in seconds.items()}
                tokens = sum(len(ids) for ids in out["input_ids"])
                sets[name] = {
                    "samples": len(data), "tokens_per_sample": tokens / len(data), "seconds": median,
                    "ratio_vs_plain": median["plain_batched_map"] / median["finetune_tokenize_mask"],
                    "repetitions": {contender: [round(v, 4) for v in values] for contender, values in seconds.items()},
                }  # fmt: skip
        finally:
            datasets.enable_caching()
        timings = {}
        for label in ("first", "cached"):
            began = time.perf_counter()
            _, stats = prepare_split(short, tokenizer, cfg, seed=42)
            timings[label] = time.perf_counter() - began
        return {
            "metric": "tokens_per_second",
            "target_ratio_vs_plain": 0.9,
            "sets": sets,
            "pack_rate": {label: stats.num_tokens / seconds for label, seconds in timings.items()},
        }

    def packing(self) -> dict:
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

        tokenizer = AutoTokenizer.from_pretrained(self.work / "demo" / "base")
        demo = datasets.load_dataset("json", data_files=str(self.data), split="train")
        demo = tokenize(demo, tokenizer, DataConfig(train_path=str(self.data), max_length=256, format="chat"))
        rng = numpy.random.default_rng(0)
        count = 4 * WINDOW if self.quick else 25 * WINDOW
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

    def loss_path(self) -> dict:
        """train.loss_path chunked vs full_logits on a head-dominated shape (vocabulary 128,256, hidden 64, a row of
        2,048 tokens, fp32, one process; bench/loss_path.py): step peak and bytes saved for backward as
        fractions of the fp32 logits' size, and tokens/s, each path in processes of its own, interleaved."""
        vocab, hidden, rows, steps = (8192, 64, 256, 2) if self.quick else (128_256, 64, 2048, 5)
        runs: dict[str, list[dict]] = {"chunked": [], "full_logits": []}
        for repeat in range(self.repeats):
            for path in runs:
                out = self.work / "runs" / f"loss-{path}-{repeat}.json"
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
            "tokens_per_second_ratio": median["chunked"]["tokens_per_second"]
            / median["full_logits"]["tokens_per_second"],
            "targets": {"step_peak_over_logits": 0.3, "saved_over_logits": 0.05, "tokens_per_second_ratio": 0.95},
        }

    def export(self) -> dict:
        """`finetune export` vs `accelerate merge-weights` on one SHARDED checkpoint: time and peak RSS."""
        size = SIZES["tiny" if self.quick else "export"]
        self.finetune_run(
            "export-source", size, "fsdp2_full_shard.yaml",
            **{"train.max_steps": 1, "checkpoint.save_every_steps": 1, "train.micro_batch_size": 1},
        )  # fmt: skip
        checkpoint = self.work / "runs" / "export-source" / "checkpoints" / "step_1"
        shard_size = "20MB" if self.quick else "200MB"
        contenders = {
            "finetune_export": lambda out: [sys.executable, "-m", "finetune", "export", str(checkpoint), str(out),
                                            "--max-shard-size", shard_size],
            "accelerate_merge_weights": lambda out: [
                sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
                str(checkpoint / "pytorch_model_fsdp_0"), str(out),
            ],
        }  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for repeat in range(self.repeats):
            for name, command in contenders.items():
                out = self.work / "exports" / f"{name}-{repeat}"
                shutil.rmtree(out, ignore_errors=True)
                seconds, peak = _timed_peak_rss(command(out))
                largest = max(p.stat().st_size for p in out.glob("*.safetensors"))
                runs[name].append({"seconds": seconds, "peak_rss_bytes": peak, "largest_file_bytes": largest})
        # The fixed overhead: the same exporter on the tiny model (interpreter, torch, transformers).
        tiny_checkpoint = checkpoint
        if not self.quick:
            self.finetune_run(
                "export-tiny", SIZES["tiny"], "fsdp2_full_shard.yaml",
                **{"train.max_steps": 1, "checkpoint.save_every_steps": 1},
            )  # fmt: skip
            tiny_checkpoint = self.work / "runs" / "export-tiny" / "checkpoints" / "step_1"
        overhead_out = self.work / "exports" / "overhead"
        shutil.rmtree(overhead_out, ignore_errors=True)
        _, overhead = _timed_peak_rss(
            [sys.executable, "-m", "finetune", "export", str(tiny_checkpoint), str(overhead_out)]
        )
        median = _medians(runs)
        ours = median["finetune_export"]
        return {
            "size": size.name,
            "runs": runs,
            "median": median,
            "fixed_overhead_rss_bytes": overhead,
            "peak_over_largest_shard": (ours["peak_rss_bytes"] - overhead) / ours["largest_file_bytes"],
            "target_peak_over_largest_shard": 1.2,
            "time_ratio_vs_merge_weights": ours["seconds"] / median["accelerate_merge_weights"]["seconds"],
        }

    # ---- adapters (LoRA) -----------------------------------------------------------------------

    def lora_vs_full(self) -> dict:
        """LoRA against full fine-tuning on the same model, data and FSDP2 launch: step time, rank 0's
        measured memory, and the bytes of one checkpoint."""
        size = self.train_size
        save = {"checkpoint.save_every_steps": self.steps}
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for repeat in range(self.repeats):
            for name, overrides in (("full", save), ("lora", {**save, **LORA})):
                metrics = self.finetune_run(f"{name}-{repeat}", size, "fsdp2_full_shard.yaml", **overrides)
                checkpoint = self.work / "runs" / f"{name}-{repeat}" / "checkpoints" / f"step_{self.steps}"
                runs[name].append({
                    "step_seconds": _steady_median(metrics["step_seconds"]),
                    "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()),
                    **{key.split("/")[-1]: value for key, value in metrics["memory"].items()},
                })  # fmt: skip
        median = _medians(runs)
        full, lora = median["full"], median["lora"]
        return {
            "size": size.name,
            "lora": LORA,
            "runs": runs,
            "median": median,
            "step_time_ratio": lora["step_seconds"] / full["step_seconds"],
            "peak_ratio": lora["step_peak"] / full["step_peak"],
            "checkpoint_bytes_ratio": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
        }

    def trl_lora(self) -> dict:
        """finetune LoRA against TRL's SFTTrainer + PEFT (packing, padding-free): target tokens/s, both DDP
        on 2 processes, same model, data, targets and adapters."""
        size = self.train_size
        model = self.model(size)
        results: dict[str, list[float]] = {"finetune_lora_ddp": [], "trl_sft_lora_ddp": []}
        for repeat in range(self.repeats):
            metrics = self.finetune_run(f"lora-ddp-{repeat}", size, "ddp.yaml", **LORA)
            results["finetune_lora_ddp"].append(_steady_rate(metrics["target_tokens"], metrics["step_seconds"]))
            self.curves.setdefault("finetune LoRA (DDP)", metrics["loss"])
            out = self.work / "runs" / f"trl-{repeat}.json"
            _run([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "trl_sft.py"), str(model), str(self.data), str(self.steps),
                "8", "128", str(LORA["peft.r"]), str(out),
            ])  # fmt: skip
            trl = json.loads(out.read_text())
            results["trl_sft_lora_ddp"].append(_steady_rate(trl["target_tokens"], trl["step_seconds"]))
        ratio = _ratio(
            "target_tokens_per_second", "finetune_lora_ddp", results["finetune_lora_ddp"], "trl_sft_lora_ddp",
            results["trl_sft_lora_ddp"], target=1.1, size=size,
        )  # fmt: skip
        return ratio | {"trl_version": _version("trl")}

    # ---- preference tuning --------------------------------------------------------------------------

    def dpo(self) -> dict:
        """DPO (beta 0.1) against TRL's DPOTrainer (bench/trl_dpo.py: DDP, chosen and rejected padded into one
        forward) with its defaults (a reference model run every step) and at its best for the same work (its
        reference precomputed), 2 processes, same model, pairs and micro-batch of 8 pairs of varied lengths, fp32
        both: pairs/s, the peak resident memory of the largest process, and the rows' fill. finetune runs packed,
        its reference precomputed, under DDP (the same engine as TRL's) and FSDP2. LoRA on every linear layer:
        the policy with its adapters off as the reference, or (like with like against TRL's precompute) the
        reference precomputed. A precompute pass is counted both ways: pairs/s of the steps alone, and over one
        epoch of the same pairs with the pass's time added."""
        size = SIZES["tiny" if self.quick else "dpo"]
        model = self.model(size)
        count, steps = (64, 4) if self.quick else (160, 8)
        pairs = self.work / f"pairs-{count}.jsonl"
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
        runs: dict[str, list[dict]] = {name: [] for name in [*contenders, *peers]}
        for repeat in range(self.repeats):
            for name, (config, settings) in contenders.items():
                command, out = self.finetune_command(f"dpo-{name}-{repeat}", size, config, **dpo, **settings)
                log = self.work / "runs" / f"dpo-{name}-{repeat}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                # A cache of its own: every run tokenizes and precomputes its reference (none reads another's).
                cache = {"HF_DATASETS_CACHE": str(self.work / "runs" / f"dpo-{name}-{repeat}-cache")}
                _, peak = _timed_peak_rss(command, stdout=log, env=ENV | cache)
                entries = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                steps_of = [e for e in entries if "loss" in e]
                rate = _steady_rate([e["pairs"] for e in steps_of], [e["step_seconds"] for e in steps_of])
                said = re.search(r"precomputed with the initial weights in ([0-9.]+) s", log.read_text())
                runs[name].append(_dpo_measured(rate, peak, statistics.median(e["fill"] for e in steps_of),
                                                float(said[1]) if said else 0.0, count))  # fmt: skip
                if name == "finetune_full_ddp":
                    self.curves.setdefault("finetune DPO (DDP)", [e["loss"] for e in steps_of])
            for name, (rank, precompute) in peers.items():
                result = self.work / "runs" / f"{name}-{repeat}.json"
                _, peak = _timed_peak_rss([
                    sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(_free_port()), str(REPO / "bench" / "trl_dpo.py"), str(model), str(pairs), str(steps), "8",
                    "256", str(rank), str(result), "1" if precompute else "0",
                ])  # fmt: skip
                trl = json.loads(result.read_text())
                rate = _steady_rate(trl["pairs"], trl["step_seconds"])
                fill = sum(trl["tokens"]) / sum(trl["slots"])
                runs[name].append(_dpo_measured(rate, peak, fill, trl["precompute_seconds"], count))
        median = _medians(runs)
        compared = {
            "finetune_full_ddp": "trl_full", "finetune_full_fsdp2": "trl_full", "finetune_lora_ddp": "trl_lora",
            "finetune_full_ddp@best": "trl_full_precomputed",
            "finetune_lora_ddp_precomputed": "trl_lora_precomputed",
        }  # fmt: skip
        ratios = {}
        for name, peer in compared.items():
            ours, theirs = median[name.removesuffix("@best")], median[peer]
            ratios[name] = {key: ours[key] / theirs[key] for key in ("pairs_per_second", "epoch_pairs_per_second")}
            ratios[name]["peak_rss"] = ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]
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

    def moe(self) -> dict:
        """A mixture of experts (Qwen3-MoE, 8 experts, top 2) trained in full, DDP on 2 processes, with the routers'
        balancing loss on: target tokens/s with transformers' grouped_mm experts against its per-expert loop
        (`eager`), and against TRL's SFTTrainer, whose model adds its own balancing loss (output_router_logits)."""
        size = self.train_size
        model = self.model(size, experts=8)
        runs: dict[str, list[float]] = {"grouped_mm": [], "eager": [], "trl_sft_moe_ddp": []}
        for repeat in range(self.repeats):
            for experts in ("grouped_mm", "eager"):
                overrides = {"model.name_or_path": model, "model.experts_implementation": experts}
                metrics = self.finetune_run(f"moe-{experts}-{repeat}", size, "ddp.yaml", **overrides)
                runs[experts].append(_steady_rate(metrics["target_tokens"], metrics["step_seconds"]))
                if experts == "grouped_mm":
                    self.curves.setdefault("finetune MoE (DDP)", metrics["loss"])
            out = self.work / "runs" / f"trl-moe-{repeat}.json"
            _run([
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(REPO / "bench" / "trl_sft.py"), str(model), str(self.data), str(self.steps),
                "8", "128", "0", str(out), "router_aux",
            ])  # fmt: skip
            trl = json.loads(out.read_text())
            runs["trl_sft_moe_ddp"].append(_steady_rate(trl["target_tokens"], trl["step_seconds"]))
        metric = "target_tokens_per_second"
        return {
            "experts": _ratio(metric, "grouped_mm", runs["grouped_mm"], "eager", runs["eager"], target=1.0, size=size),
            "trl": _ratio(
                metric,
                "grouped_mm",
                runs["grouped_mm"],
                "trl_sft_moe_ddp",
                runs["trl_sft_moe_ddp"],
                target=1.1,
                size=size,
            ),
            "trl_version": _version("trl"),
        }

    def merge(self) -> dict:
        """`finetune export --merge` against PEFT's merge_and_unload() + save_pretrained on one adapter of
        a model of several hundred million parameters: time and peak RSS."""
        size = SIZES["tiny" if self.quick else "export"]
        self.finetune_run(
            "merge-source", size, "fsdp2_full_shard.yaml",
            **{**LORA, "train.max_steps": 1, "checkpoint.save_every_steps": 1, "train.micro_batch_size": 1,
               "output.export": "true"},
        )  # fmt: skip
        source = self.work / "runs" / "merge-source"
        shard_size = "20MB" if self.quick else "200MB"
        contenders = {
            "finetune_export_merge": lambda out: [
                sys.executable, "-m", "finetune", "export", str(source / "checkpoints" / "step_1"), str(out),
                "--merge", "--max-shard-size", shard_size,
            ],
            "peft_merge_and_unload": lambda out: [
                sys.executable, str(REPO / "bench" / "peft_merge.py"), str(self.model(size)), str(source / "final"),
                str(out), shard_size,
            ],
        }  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for repeat in range(self.repeats):
            for name, command in contenders.items():
                out = self.work / "exports" / f"{name}-{repeat}"
                shutil.rmtree(out, ignore_errors=True)
                seconds, peak = _timed_peak_rss(command(out))
                runs[name].append({"seconds": seconds, "peak_rss_bytes": peak})
        median = _medians(runs)
        ours, theirs = median["finetune_export_merge"], median["peft_merge_and_unload"]
        return {
            "size": size.name,
            "parameters": _parameters(self.model(size)),
            "runs": runs,
            "median": median,
            "peak_ratio": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
            "target_peak_ratio": 0.5,
            "time_ratio": ours["seconds"] / theirs["seconds"],
        }


# The adapters every LoRA benchmark trains: rank 16 on every linear layer, no dropout.
LORA = {"peft.r": 16, "peft.alpha": 32, "peft.dropout": 0.0, "peft.target_modules": "[all-linear]"}


# ---- measurement helpers ---------------------------------------------------------------------


def _run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(
            f"bench: {' '.join(command[:6])} ... failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )


def _timed_peak_rss(command: list[str], stdout: Path | None = None, env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak resident bytes of `command`'s largest process, started from a small process
    (bench/peak_rss.py); its output is kept in `stdout` if given."""
    keep = ["--stdout", str(stdout)] if stdout else []
    wrapper = [sys.executable, str(REPO / "bench" / "peak_rss.py"), *keep, *command]
    result = subprocess.run(wrapper, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"bench: {' '.join(command[:6])} ... failed:\n{result.stderr[-4000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return measured["seconds"], measured["peak_rss_bytes"]


def long_chats(conversations: list[list[dict]], count: int, turns: int = 3, per_turn: int = 40) -> list[dict]:
    """`count` multi-turn chats of about 2,000 demo tokens: each message joins `per_turn` of the demo's."""
    chats, pool = [], iter(conversations * (count * turns * per_turn // max(len(conversations), 1) + 1))
    for _ in range(count):
        messages = []
        for _ in range(turns):
            pieces = [next(pool) for _ in range(per_turn)]
            for role, position in (("user", 0), ("assistant", 1)):
                messages.append({"role": role, "content": " ".join(chat[position]["content"] for chat in pieces)})
        chats.append({"messages": messages})
    return chats


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


def _metrics(path: Path) -> dict:
    """Per-step series from a run's metrics.jsonl, and its step-1 memory report."""
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [e for e in entries if "loss" in e]
    memory = next(e for e in entries if "memory/rank0/parameters" in e)
    return {
        "loss": [e["loss"] for e in steps],
        "step_seconds": [e["step_seconds"] for e in steps],
        "target_tokens": [e["target_tokens"] for e in steps],
        "checkpoint_seconds": [e["checkpoint_seconds"] for e in entries if "checkpoint_seconds" in e],
        "memory": {k: v for k, v in memory.items() if k.startswith("memory/rank0/")},
    }


def _dpo_measured(rate: float, peak: int, fill: float, precompute_seconds: float, pairs: int) -> dict:
    """One DPO run's figures; the epoch rate counts its reference precompute pass (if any) in one epoch of `pairs`."""
    epoch = pairs / rate
    return {
        "pairs_per_second": rate, "peak_rss_bytes": peak, "fill": fill, "precompute_seconds": precompute_seconds,
        "epoch_pairs_per_second": pairs / (epoch + precompute_seconds),
        "precompute_fraction_of_epoch": precompute_seconds / epoch,
    }  # fmt: skip


def _medians(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender, the median of each measured field over its repetitions."""
    return {
        name: {key: statistics.median(r[key] for r in values) for key in values[0]} for name, values in runs.items()
    }


def _steady(values: list[float]) -> list[float]:
    """Drop the first steps (allocations, first collectives, caches) when there are enough."""
    return values[2:] if len(values) > 4 else values


def _steady_median(step_seconds: list[float]) -> float:
    return statistics.median(_steady(step_seconds))


def _steady_rate(tokens: list[int], step_seconds: list[float]) -> float:
    return sum(_steady(tokens)) / sum(_steady(step_seconds))


def _ratio(
    metric: str, a: str, a_values: list[float], b: str, b_values: list[float], target: float, size: Size
) -> dict:
    return {
        "metric": metric,
        "size": size.name,
        "runs": {a: a_values, b: b_values},
        "median": {a: statistics.median(a_values), b: statistics.median(b_values)},
        "ratio": statistics.median(a_values) / statistics.median(b_values),
        "target": target,
    }


def _parameters(model_dir: Path) -> int:
    from transformers import AutoConfig

    from finetune.model import meta_model

    return sum(p.numel() for p in meta_model(AutoConfig.from_pretrained(model_dir)).parameters())


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _free_port() -> int:
    from finetune.distributed import free_port

    return free_port()


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


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
    for name, rows in ROWS.items():
        if name in results:
            lines += rows(results[name])
    if "scaling" in results:
        lines += ["", *_scaling_rows(results["scaling"])]
    return "\n".join(lines) + "\n"


MIB = 2**20


def _row(comparison: str, finetune: str, peer: str, ratio: str = "", target: str = "") -> str:
    """One row of the comparison table; an empty cell is written "| |"."""
    cells = (comparison, finetune, peer, ratio, target)
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def _loop_rows(loop: dict) -> list[str]:
    median = loop["median"]
    return [
        _row(
            f"loop overhead, steps/s ({loop['size']})", f"{median['finetune']:.2f}",
            f"{median['handwritten_fsdp2']:.2f} (hand-written FSDP2)", f"{loop['ratio']:.3f}", f">= {loop['target']}",
        )
    ]  # fmt: skip


def _trainer_rows(trainer: dict) -> list[str]:
    median, size = trainer["median"], trainer["size"]
    return [
        _row(
            f"target tokens/s vs Trainer DDP ({size})",
            f"DDP {median['finetune_ddp']:.0f}, FSDP2 {median['finetune_fsdp2']:.0f}", f"{median['trainer_ddp']:.0f}",
            f"DDP {trainer['ratio_ddp']:.2f}x, FSDP2 {trainer['ratio_fsdp2']:.2f}x", f">= {trainer['target']}x",
        ),
        _row(
            f"target tokens/s vs TRL SFTTrainer {trainer['trl_version']} (packing, padding-free; {size}, DDP)",
            f"{median['finetune_ddp']:.0f}", f"{median['trl_sft_ddp']:.0f}", f"{trainer['ratio_trl_ddp']:.2f}x",
            f">= {trainer['target_trl']}x",
        ),
    ]  # fmt: skip


def _export_rows(export: dict) -> list[str]:
    ours, theirs = export["median"]["finetune_export"], export["median"]["accelerate_merge_weights"]
    return [
        _row(
            f"export time, s ({export['size']})", f"{ours['seconds']:.1f}", f"{theirs['seconds']:.1f} (merge-weights)",
            f"{export['time_ratio_vs_merge_weights']:.2f}", "<= 1",
        ),
        _row(
            "export peak RSS, MiB", f"{ours['peak_rss_bytes'] / MIB:.0f}",
            f"{theirs['peak_rss_bytes'] / MIB:.0f} (merge-weights)",
            f"(peak - {export['fixed_overhead_rss_bytes'] / MIB:.0f} MiB overhead) / largest shard "
            f"{ours['largest_file_bytes'] / MIB:.0f} MiB = {export['peak_over_largest_shard']:.2f}",
            f"<= {export['target_peak_over_largest_shard']}",
        ),
    ]  # fmt: skip


def _save_rows(save: dict) -> list[str]:
    median = save["median"]
    return [
        _row(
            f"checkpoint save, s blocked ({save['size']})", f"SHARDED {median['sharded']:.2f}",
            f"FULL {median['full']:.2f}",
        ),
        _row(
            f"asynchronous checkpoint save, s blocked ({save['size']}, SHARDED)", f"{median['sharded_async']:.3f}",
            f"{median['sharded']:.3f} (synchronous)", f"{save['async_over_sync']:.2f}",
            f"<= {save['target_async_over_sync']}",
        ),
    ]  # fmt: skip


def _data_rows(data: dict) -> list[str]:
    rows = [
        _row(
            f"tokenize + mask vs batched render + tokenize map, s ({sets['samples']} {name} chats, "
            f"{sets['tokens_per_sample']:.0f} tokens each)", f"{sets['seconds']['finetune_tokenize_mask']:.2f}",
            f"{sets['seconds']['plain_batched_map']:.2f}", f"{sets['ratio_vs_plain']:.2f}x",
            f">= {data['target_ratio_vs_plain']}x",
        )
        for name, sets in data["sets"].items()
    ]  # fmt: skip
    rate = data["pack_rate"]
    return [
        *rows,
        _row(
            "tokenize + mask + pack, tokens/s (short chats)",
            f"first {rate['first']:.0f}",
            f"cached {rate['cached']:.0f}",
        ),
    ]


def _packing_rows(packing: dict) -> list[str]:
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


def _loss_rows(loss: dict) -> list[str]:
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


def _lora_rows(lora: dict) -> list[str]:
    full, adapted = lora["median"]["full"], lora["median"]["lora"]
    return [
        _row(
            f"LoRA r={lora['lora']['peft.r']} vs full, step s ({lora['size']}, FSDP2)",
            f"{adapted['step_seconds']:.3f}",
            f"{full['step_seconds']:.3f} (full)", f"{lora['step_time_ratio']:.2f}",
        ),
        _row(
            "LoRA vs full, rank 0 step peak MiB", f"{adapted['step_peak'] / MIB:.0f}",
            f"{full['step_peak'] / MIB:.0f} (full)", f"{lora['peak_ratio']:.2f}",
        ),
        _row(
            "LoRA vs full, checkpoint MiB", f"{adapted['checkpoint_bytes'] / MIB:.2f}",
            f"{full['checkpoint_bytes'] / MIB:.2f} (full)", f"{lora['checkpoint_bytes_ratio']:.3f}",
        ),
    ]  # fmt: skip


def _trl_lora_rows(trl: dict) -> list[str]:
    return [
        _row(
            f"LoRA target tokens/s vs TRL SFTTrainer {trl['trl_version']} + PEFT ({trl['size']}, DDP)",
            f"{trl['median']['finetune_lora_ddp']:.0f}", f"{trl['median']['trl_sft_lora_ddp']:.0f}",
            f"{trl['ratio']:.2f}x", f">= {trl['target']}x",
        )
    ]  # fmt: skip


def _dpo_rows(dpo: dict) -> list[str]:
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
    rows.append(
        _row(f"DPO reference precompute, fraction of one epoch of {dpo['pairs']} pairs (DDP, full)",
             f"{dpo['precompute_fraction_of_epoch']:.2f}",
             f"{median['trl_full_precomputed']['precompute_fraction_of_epoch']:.2f} (precompute_ref_log_probs)")
    )  # fmt: skip
    return rows


def _moe_rows(moe: dict) -> list[str]:
    experts, trl = moe["experts"], moe["trl"]
    return [
        _row(
            f"MoE target tokens/s, grouped_mm vs per-expert loop ({experts['size']}, 8 experts top 2, DDP)",
            f"{experts['median']['grouped_mm']:.0f}", f"{experts['median']['eager']:.0f}", f"{experts['ratio']:.2f}x",
            f">= {experts['target']}x",
        ),
        _row(
            f"MoE target tokens/s vs TRL SFTTrainer {moe['trl_version']}, balancing loss on in both (DDP)",
            f"{trl['median']['grouped_mm']:.0f}", f"{trl['median']['trl_sft_moe_ddp']:.0f}", f"{trl['ratio']:.2f}x",
            f">= {trl['target']}x",
        ),
    ]  # fmt: skip


def _merge_rows(merge: dict) -> list[str]:
    ours, peft = merge["median"]["finetune_export_merge"], merge["median"]["peft_merge_and_unload"]
    return [
        _row(
            f"merged export, s ({merge['size']}, {merge['parameters']:,} parameters)", f"{ours['seconds']:.1f}",
            f"{peft['seconds']:.1f} (merge_and_unload + save_pretrained)", f"{merge['time_ratio']:.2f}",
        ),
        _row(
            "merged export peak RSS, MiB", f"{ours['peak_rss_bytes'] / MIB:.0f}",
            f"{peft['peak_rss_bytes'] / MIB:.0f}",
            f"{merge['peak_ratio']:.2f}", f"<= {merge['target_peak_ratio']}",
        ),
    ]  # fmt: skip


def _scaling_rows(scaling: dict) -> list[str]:
    lines = [
        "Scaling (global batch 16 rows x 128 tokens; rank 0 bytes measured in step 1):",
        "",
        "| size | params | processes | strategy | step s | params MiB | grads MiB | optimizer MiB | activations MiB "
        "| step peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in scaling["rows"]:
        mem = row["rank0_bytes"]
        lines.append(
            f"| {row['size']} | {row['parameters'] or 0:,} | {row['processes']} | {row['strategy']} | "
            f"{row['step_seconds']:.3f} | {mem.get('parameters', 0) / MIB:.1f} | "
            f"{mem.get('gradients', 0) / MIB:.1f} | "
            f"{mem.get('optimizer_state', 0) / MIB:.1f} | {mem.get('activations', 0) / MIB:.1f} | "
            f"{mem.get('step_peak', 0) / MIB:.0f} |"
        )
    return lines


# The comparison table's rows of each section, in the table's order.
ROWS = {
    "loop_overhead": _loop_rows,
    "trainer": _trainer_rows,
    "export": _export_rows,
    "checkpoint_save": _save_rows,
    "data_pipeline": _data_rows,
    "packing": _packing_rows,
    "loss_path": _loss_rows,
    "lora_vs_full": _lora_rows,
    "trl_lora": _trl_lora_rows,
    "dpo": _dpo_rows,
    "moe": _moe_rows,
    "merge": _merge_rows,
}
SECTIONS = ("data_pipeline", "packing", "loss_path", "loop_overhead", "trainer", "checkpoint_save", "scaling",
            "export", "lora_vs_full", "trl_lora", "dpo", "moe", "merge")  # fmt: skip
"""Every comparison, in the order `make bench` runs them."""


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
