"""The benchmark scripts run end to end on tiny sizes. No timing is asserted: numbers only mean
something as ratios on one quiet machine (`make bench`), never as pass/fail in a test suite.

The runs of the scripts are marked `bench`: `make test-bench` runs them and `make test` leaves them out (they are
a quarter of the suite's CPU time: some 45 launches); CI runs both."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import REPO

from finetune.plan.flops import flops_per_token, peak_flops

pytestmark = pytest.mark.multiprocess


def run_script(script: str, tmp_path, *options: str) -> dict:
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--quick", "--work", str(tmp_path / "work"), "--out", str(out),
         *options],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (json_file,) = out.glob("*.json")
    assert json_file.with_suffix(".md").read_text().count("|") > 20
    return json.loads(json_file.read_text()) | {"_files": sorted(p.name for p in out.iterdir())}


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.bench
def test_make_bench_runs_every_comparison(tmp_path):
    results = run_script("run.py", tmp_path)
    assert any(name.endswith("-loss.png") for name in results["_files"])
    assert any(name.endswith("-memory.png") for name in results["_files"])
    assert positive(results["loop_overhead"]["ratio"])
    assert (
        all(positive(v) for v in results["trainer"]["median"].values())
        and "trl_sft_ddp" in results["trainer"]["median"]
    )
    assert positive(results["export"]["median"]["finetune_export"]["peak_rss_bytes"])
    assert positive(results["export"]["median"]["accelerate_merge_weights"]["seconds"])
    assert all(results["checkpoint_save"]["runs"][name] for name in ("sharded", "sharded_async", "full"))
    assert {(r["processes"], r["strategy"]) for r in results["scaling"]["rows"]} == {
        (1, "single"), (2, "full_shard"), (2, "ddp")
    }  # fmt: skip
    # Sharding is visible in the measured memory: full shard holds half of DDP's parameters per rank.
    rows = {r["strategy"]: r for r in results["scaling"]["rows"] if r["processes"] == 2}
    assert rows["full_shard"]["rank0_bytes"]["parameters"] < 0.6 * rows["ddp"]["rank0_bytes"]["parameters"]
    data = results["data_pipeline"]
    assert set(data["sets"]) == {"short", "long"} and data["sets"]["long"]["tokens_per_sample"] > 1000
    assert all(positive(s) for d in data["sets"].values() for s in d["seconds"].values())
    assert all(positive(v) for v in data["pack_rate"].values())
    packing = results["packing"]["sets"]  # fills, not times: best fit never needs more rows than next fit
    assert len(packing) == 3 and all(row["best_fit"]["rows"] <= row["next_fit"]["rows"] for row in packing.values())
    # The chunked loss keeps less for backward than the full logits (a size, not a time).
    loss = results["loss_path"]["median"]
    assert all(positive(v) for path in loss.values() for v in path.values())
    assert loss["chunked"]["saved_over_logits"] < loss["full_logits"]["saved_over_logits"]
    # Adapters: a LoRA checkpoint holds a fraction of a full one; the peers ran and were measured.
    lora = results["lora_vs_full"]
    assert lora["checkpoint_bytes_ratio"] < 0.5 and positive(lora["step_time_ratio"])
    assert all(positive(v) for v in results["trl_lora"]["median"].values())
    dpo = results["dpo"]  # preference tuning against TRL's DPOTrainer, full and LoRA
    assert len(dpo["median"]) == 4 and positive(dpo["precompute_fraction_of_epoch"])
    for name, run in dpo["median"].items():  # a precompute pass where a reference is precomputed, none elsewhere
        timed = ("precompute_seconds", "precompute_fraction_of_epoch")
        assert all(positive(v) for key, v in run.items() if key not in timed), name
        precomputes = "precomputed" in name or name.startswith("finetune_full")
        assert (run["precompute_seconds"] > 0) == precomputes, name
    assert set(dpo["ratios"]) == {"finetune_full_ddp", "finetune_lora_ddp_precomputed"}
    assert all(positive(v) for ratio in dpo["ratios"].values() for v in ratio.values())
    assert all(positive(v) for part in ("experts", "trl") for v in results["moe"][part]["median"].values())
    assert all(positive(v["peak_rss_bytes"]) for v in results["merge"]["median"].values())
    long = results["long_context"]  # sequence parallelism alone in a quick run: sp=2 holds less than one process
    assert set(long["median"]) == {"one", "sp2"} and 0 < long["activation_ratio"] < 1
    grpo = results["grpo"]["shapes"]["instructed"]  # online RL against TRL's GRPOTrainer, generation included
    assert set(grpo["median"]) == {"finetune_ddp", "finetune_fsdp2", "trl"} and grpo["prompt_tokens"] > 100
    assert all(positive(v) for run in grpo["ratios"].values() for v in run.values())
    assert all(positive(grpo["median"][name]["completion_tokens"]) for name in ("finetune_ddp", "finetune_fsdp2"))
    distill = results["distill"]  # distillation against TRL's GKDTrainer, on the data's replies and on-policy
    assert set(distill["median"]) == {"off_finetune_ddp_table", "on_finetune_fsdp2", "off_trl"}
    assert all(positive(v) for run in distill["median"].values() for v in run.values())
    assert positive(distill["median"]["off_finetune_ddp_table"]["table_seconds"])  # computed, not read
    assert set(distill["ratios"]) == {"off_finetune_ddp_table"}
    assert all(positive(v) for v in distill["ratios"]["off_finetune_ddp_table"].values())
    agent = results["agent"]  # episodes that call a tool against TRL's GRPOTrainer with tools
    assert set(agent["median"]) == {"finetune_fsdp2", "trl"}  # quick: FSDP2 alone of finetune's engines
    assert all(positive(v) for ratio in agent["ratios"].values() for v in ratio.values())
    assert all(positive(agent["median"][name]["written_tokens"]) for name in agent["median"])
    # Reward models against TRL's RewardTrainer (neither recomputing activations), KTO against its KTOTrainer at its
    # best: DDP both in a quick run.
    assert set(results["reward_model"]["median"]) == {"finetune_ddp", "trl_no_recompute"}
    assert set(results["kto"]["median"]) == {"finetune_ddp", "trl_precomputed"}
    assert positive(results["kto"]["median"]["finetune_ddp"]["precompute_seconds"])  # its default: precomputed
    for name, unit in (("reward_model", "pairs"), ("kto", "samples")):
        assert list(results[name]["ratios"]) == ["finetune_ddp" + ("@best" if name == "kto" else "")]
        assert all(positive(v) for ratio in results[name]["ratios"].values() for v in ratio.values())
        assert all(
            positive(run[f"{unit}_per_second"]) and 0 < run["fill"] <= 1 for run in results[name]["median"].values()
        )


@pytest.mark.bench
def test_make_bench_reruns_one_comparison_alone(tmp_path):
    """`--only` runs the comparisons named, and its files say which, so a partial run never reads as a whole one."""
    results = run_script("run.py", tmp_path, "--only", "loss_path")
    metadata = {"date", "commit", "machine", "quick", "repeats", "total_seconds", "_files"}
    assert set(results) - metadata == {"loss_path"}
    assert results["_files"] == [
        f"{results['date']}-{results['commit']}-quick-loss_path.{ext}" for ext in ("json", "md")
    ]
    table = (tmp_path / "results" / results["_files"][1]).read_text()
    assert "loss chunked, tokens/s" in table and "loop overhead" not in table and "Scaling" not in table
    refused = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--only", "loss,trainer"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--only takes comparisons of: data_pipeline" in refused.stderr


@pytest.mark.bench
def test_bench_gpu_runs_on_cpu_in_quick_mode(tmp_path):
    """Three of its variants (each a launch; every variant is the same script with other settings): the reference
    loss path, the packed rows' varlen attention, and activation checkpointing, each with one profiled step."""
    variants = ["full logits, no checkpointing", "chunked loss, varlen attention", "chunked loss, full checkpointing"]
    chosen = [option for variant in variants for option in ("--variant", variant)]
    results = run_script("gpu.py", tmp_path, "--profile", "4,4", *chosen)
    assert [row["variant"] for row in results["rows"]] == variants
    assert all(positive(row["tokens_per_second_per_gpu"]) and row["mfu"] is None for row in results["rows"])
    # --profile: every variant's rank-0 operator table, in the results and beside them.
    assert all("aten::mm" in row["profile"] for row in results["rows"])
    assert sum(name.endswith(".txt") and "-profile-chunked-loss" in name for name in results["_files"]) == 2


def run_gpu_check(tmp_path, budget: int, only: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--budget", str(budget), "--out", str(out),
               "--work", str(tmp_path / "work"), *(["--only", only] if only else [])]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    return result, json.loads((out / "summary.json").read_text())


@pytest.mark.bench
def test_gpu_check_dry_runs_every_step_in_its_cpu_form(tmp_path):
    """`make gpu-check` without a GPU: each step's command line runs (tests collected, a short demo, bench
    --quick, one profiled step), everything in one folder of at most 8 files, as the device tool needs."""
    result, summary = run_gpu_check(tmp_path, budget=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gpu-check: no GPU: dry run" in result.stdout and summary["mode"] == "no GPU: dry run"
    steps = {step["name"]: step for step in summary["steps"]}
    assert list(steps) == [
        "environment", "test-gpu", "demo", "grpo", "decode", "bench", "profile", "long-context", "test-launches"
    ]  # fmt: skip
    assert all(step["status"] == "passed" for step in steps.values()), summary
    assert "torch " in steps["environment"]["lines"][-1] and "transformers " in steps["environment"]["lines"][-1]
    assert (
        "tests collected" in steps["test-gpu"]["lines"][0] and "tests collected" in steps["test-launches"]["lines"][0]
    )
    assert any("fine-tuned (exported)" in line and "/200" in line for line in steps["demo"]["lines"])
    # The GRPO demo's CPU form: a partly trained reverser, 2 GRPO steps, their rates and exact match from the logs.
    assert steps["grpo"]["lines"][0].startswith("training: ") and "generation " in steps["grpo"]["lines"][0]
    assert steps["grpo"]["lines"][2].startswith("exact match on the held-out lists: before ")
    # Rollout decoding's CPU form: the tiny model, the ways that need no GPU, the static ones writing the same tokens.
    assert [line.split(" | ")[0] for line in steps["decode"]["lines"][1:]] == ["| dynamic", "| generate", "| static"]
    assert all(line.endswith("| 100.0% |") for line in steps["decode"]["lines"][2:])
    assert [line.split(":")[0] for line in steps["bench"]["lines"]] == [
        "chunked loss, varlen attention, micro-batch 16"
    ]
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8 and {"summary.md", "summary.json", "test-gpu.log", "demo.log", "bench.log"} <= set(files)
    (table,) = [name for name in files if "-profile-" in name]
    assert "aten::mm" in (tmp_path / "out" / table).read_text()
    results = json.loads((tmp_path / "out" / (table.split("-profile-")[0] + ".json")).read_text())
    assert [row["micro_batch"] for row in results["rows"]] == [16]
    # The long-context search in its CPU form: both models, without and with offload, each fitting 512 tokens.
    assert [line.split(": ")[0] for line in steps["long-context"]["lines"]] == [
        "llama-3.2-1b full", "llama-3.2-1b full, offload", "llama-3.1-8b lora", "llama-3.1-8b lora, offload"
    ]  # fmt: skip
    assert all("longest 512 tokens at " in line and "; the plan's " in line for line in steps["long-context"]["lines"])
    assert all(positive(row["fill"]) and row["fill"] <= 1 for row in results["rows"])


@pytest.mark.bench
def test_gpu_check_skips_what_its_budget_cannot_hold_and_runs_the_steps_it_is_given(tmp_path):
    result, summary = run_gpu_check(tmp_path, budget=12)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    statuses = {step["name"]: step["status"] for step in summary["steps"]}
    assert statuses == {**dict.fromkeys(statuses, "skipped"), "environment": "passed"}
    assert "skipped: " in summary["steps"][1]["lines"][0] and "the step needs 30" in summary["steps"][1]["lines"][0]
    # A second command runs what the first missed; the budget is kept for the steps it names.
    result, summary = run_gpu_check(tmp_path, budget=200, only="profile,test-gpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [step["name"] for step in summary["steps"]] == ["environment", "test-gpu", "profile"]
    assert summary["steps"][1]["status"] == "passed"


def test_model_flops_per_token_follow_the_stated_formula():
    from transformers import AutoConfig

    from finetune.model.loading import meta_model

    configs = REPO / "recipes" / "llama" / "configs"
    untied = meta_model(AutoConfig.from_pretrained(configs / "Llama-3.1-8B-Instruct" / "config.json"))
    parameters = 8_030_261_248 - 128_256 * 4096  # the input embedding is a lookup
    assert flops_per_token(untied, 2048) == 6 * parameters + 6 * 32 * 2048 * 32 * 128
    tied = meta_model(AutoConfig.from_pretrained(configs / "Llama-3.2-1B-Instruct" / "config.json"))
    assert flops_per_token(tied, 2048) == 6 * 1_235_814_400 + 6 * 16 * 2048 * 32 * 64  # tied: it is the head too
    import torch

    assert peak_flops(torch.device("cpu")) is None
