"""Real 2-process runs through `accelerate launch` on CPU over gloo: each fixture is one run, shared."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from helpers import LaunchedRun, per_sample_eval_loss
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.multiprocess

SHARDED_RUNS = ["fsdp2_run", "shard_grad_op_run", "fsdp1_run"]
ALL_RUNS = [*SHARDED_RUNS, "ddp_run"]


@pytest.mark.parametrize("run_name", ALL_RUNS)
def test_loss_goes_down(run_name, request):
    losses = request.getfixturevalue(run_name).losses()
    assert len(losses) == 16
    assert max(losses[-3:]) < 0.75 * losses[0], losses


@pytest.mark.parametrize(
    ("run_name", "distributed_type", "strategy"),
    [
        ("fsdp2_run", "FSDP", "FSDP2 (reshard_after_forward=True)"),
        ("shard_grad_op_run", "FSDP", "FSDP2 (reshard_after_forward=False)"),
        ("fsdp1_run", "FSDP", "FSDP1 (sharding_strategy=FULL_SHARD)"),
        ("ddp_run", "MULTI_CPU", "DDP"),
    ],
)
def test_both_ranks_joined_one_group(run_name, distributed_type, strategy, request):
    """Two launched processes must be one 2-rank job, never two unsynchronized 1-rank trainings."""
    reports = request.getfixturevalue(run_name).rank_reports()
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["num_processes"] == 2
        assert report["distributed_type"] == distributed_type
        assert report["strategy"].startswith(strategy)
    # Each rank trained on its own share of every global batch.
    assert reports[0]["data_fingerprint"] != reports[1]["data_fingerprint"]


@pytest.mark.parametrize("run_name", SHARDED_RUNS)
def test_each_rank_holds_half_of_every_unit(run_name, request):
    reports = request.getfixturevalue(run_name).rank_reports()
    for report in reports:
        assert 0.49 < report["numel_local"] / report["numel_global"] < 0.51
        for unit in report["units"]:
            if unit["numel_global"] >= 1000:
                assert 0.45 < unit["numel_local"] / unit["numel_global"] < 0.55, unit
    assert reports[0]["numel_local"] + reports[1]["numel_local"] >= reports[0]["numel_global"]
    # Different ranks hold different shards.
    assert reports[0]["params_fingerprint"] != reports[1]["params_fingerprint"]


def test_ddp_ranks_hold_identical_full_weights(ddp_run):
    """Different data on each rank, yet identical weights: gradients really were averaged."""
    reports = ddp_run.rank_reports()
    assert all(r["numel_local"] == r["numel_global"] for r in reports)
    assert reports[0]["params_fingerprint"] == reports[1]["params_fingerprint"]


@pytest.mark.parametrize(
    ("run_name", "plan"),
    [
        ("fsdp2_run", ["FSDP wrap plan: 8 units", "LlamaDecoderLayer", "x4", "196,864 params each"]),
        ("fsdp1_run", ["FSDP wrap plan: 5 units", "LlamaDecoderLayer", "x4", "196,864 params each"]),
    ],
)
def test_wrap_plan_is_printed(run_name, plan, request):
    log = request.getfixturevalue(run_name).log
    for fragment in plan:
        assert fragment in log


def test_run_logs_setup_and_metrics(fsdp2_run):
    log = fsdp2_run.log
    assert "strategy: FSDP2 (reshard_after_forward=True) over 2 processes on cpu" in log
    assert "train data: 6,000 samples" in log and "0 truncated" in log
    metrics = fsdp2_run.metrics()
    step_metrics = [m for m in metrics if "loss" in m]
    assert set(step_metrics[0]) == {
        "step", "loss", "lr", "grad_norm", "tokens_per_second", "step_seconds", "target_tokens", "fill"
    }  # fmt: skip
    assert 0.9 < step_metrics[0]["fill"] <= 1.0  # real tokens / row slots of the step's packed rows
    assert re.search(r"train data: .*, \d[\d,]* rows filled to (9\d\.\d)%", log)
    assert "mfu" not in step_metrics[0]  # logged only where the device's peak FLOP/s is known (GPUs)
    assert [m["step"] for m in metrics if "eval_loss" in m] == [8, 16]
    assert list((fsdp2_run.output_dir / "finetune").rglob("events.out.tfevents.*")), "tensorboard wrote nothing"
    saved = yaml.safe_load((fsdp2_run.output_dir / "recipe.yaml").read_text())
    assert saved["train"]["max_steps"] == 16 and saved["output"]["dir"] == str(fsdp2_run.output_dir)


def test_warmup_then_cosine_schedule_in_metrics(fsdp2_run):
    lrs = [m["lr"] for m in fsdp2_run.metrics() if "lr" in m]
    assert lrs[0] < lrs[1] < lrs[2]  # warmup over 2 steps, peak at the third
    assert lrs[2] == pytest.approx(3e-3)
    assert lrs[-1] == pytest.approx(3e-4)  # min_lr_ratio 0.1 at the last step
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))


@pytest.mark.parametrize("run_name", ["fsdp2_run", "fsdp1_run", "ddp_run"])
def test_export_reloads_and_reproduces_eval_loss(run_name, request, demo_assets):
    """The exported folder loads with from_pretrained and reproduces the run's final eval loss.

    The reference scores each eval sample on its own, so for the packed runs this also shows that
    attention inside a packed row did not cross sample boundaries.
    """
    run: LaunchedRun = request.getfixturevalue(run_name)
    final = run.output_dir / "final"
    assert not (run.output_dir / "final.partial").exists()
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.dtype == torch.float32
    measured = [m["eval_loss"] for m in run.metrics() if "eval_loss" in m][-1]
    assert per_sample_eval_loss(model, tokenizer, demo_assets / "data" / "eval.jsonl") == pytest.approx(
        measured, rel=1e-4
    )
