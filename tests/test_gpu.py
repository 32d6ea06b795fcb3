"""On one CUDA GPU (`make test-gpu`; skipped with the reason elsewhere): the tiny recipe launched as users launch
it, in bf16 over NCCL, with what only a GPU exercises: async checkpoints over NCCL and their resume, the
export reloaded on the device, QLoRA's 4-bit kernels, FSDP2's offload into pinned host memory.

The CPU suite proves these paths exact; here the kernels differ (bf16 rounding, atomics in backward), so the
comparisons are to tolerances well under what a wrong data order, weight or resume would show."""

from __future__ import annotations

import importlib.util
import math
import shutil

import pytest
import torch
from helpers import LaunchedRun, launch, recipe_overrides
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from finetune.storage.checkpoint import MARKER

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

BF16 = ("--mixed_precision", "bf16")
SETTINGS = {
    "train.max_steps": 8,
    "train.eval_every_steps": 4,
    "checkpoint.save_every_steps": 4,
    "checkpoint.keep_last": 2,
}


def run_on_gpu(config: str, assets, output_dir, **extra) -> LaunchedRun:
    result = launch(config, recipe_overrides(assets, output_dir, **{**SETTINGS, **extra}), num_processes=1,
                    launch_args=BF16)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


def losses_by_step(run: LaunchedRun) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in run.metrics() if "loss" in m}


def relative_distance(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def reloaded_logits(folder, reference: dict) -> torch.Tensor:
    """The exported folder loaded as a reader would, on the GPU, in bf16 autocast as training ran."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=reference["input_ids"].cuda()).logits.float().cpu()


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """FSDP2 on one GPU, bf16 mixed precision, async checkpoints at steps 4 and 8, exported."""
    output_dir = tmp_path_factory.mktemp("gpu") / "out"
    return run_on_gpu("fsdp2_full_shard.yaml", demo_assets, output_dir, **{"checkpoint.async_save": "true"})


def test_trains_on_the_gpu_in_bf16_and_the_export_reloads_with_the_trained_logits(gpu_run):
    assert "on cuda" in gpu_run.log and "compute in bfloat16" in gpu_run.log, gpu_run.log[-3000:]
    losses = gpu_run.losses()
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    reference = load_file(gpu_run.output_dir / "final_logits.safetensors")
    assert relative_distance(reloaded_logits(gpu_run.output_dir / "final", reference), reference["logits"]) < 2e-2


def test_async_checkpoints_over_nccl_complete_and_resume_the_run(gpu_run, demo_assets, tmp_path):
    root = gpu_run.output_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_8"]
    assert all((root / name / MARKER).exists() for name in ("step_4", "step_8"))
    output_dir = tmp_path / "out"
    shutil.copytree(root / "step_4", output_dir / "checkpoints" / "step_4")
    resumed = run_on_gpu(
        "fsdp2_full_shard.yaml", demo_assets, output_dir,
        **{"checkpoint.async_save": "true", "checkpoint.resume": "auto"},
    )  # fmt: skip
    first, again = losses_by_step(gpu_run), losses_by_step(resumed)
    assert sorted(again) == [5, 6, 7, 8]
    # A resume that lost the data position or the optimizer state is off by far more than bf16's kernels.
    for step in again:
        assert again[step] == pytest.approx(first[step], rel=5e-3), (step, first, again)


def test_pinned_memory_offload_trains_as_the_gpu_resident_run(gpu_run, demo_assets, tmp_path):
    """fsdp2_offload.yaml: parameters, gradients and optimizer state in pinned host memory, the optimizer step
    on the CPU; the same first losses as the run that keeps everything on the GPU."""
    offloaded = run_on_gpu(
        "fsdp2_offload.yaml", demo_assets, tmp_path / "out",
        **{"train.max_steps": 4, "checkpoint.save_every_steps": 0, "train.eval_every_steps": 0},
    )  # fmt: skip
    assert "CPU offload" in offloaded.log
    resident, moved = losses_by_step(gpu_run), losses_by_step(offloaded)
    for step in (1, 2, 3, 4):
        assert moved[step] == pytest.approx(resident[step], rel=1e-2), (step, resident, moved)


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed here: make gpu-wheels carries it to a GPU machine",
)
def test_qlora_trains_with_4bit_kernels_and_its_merged_export_reloads(demo_assets, tmp_path):
    """QLoRA as the one-GPU recipes run it (single_gpu.yaml: no FSDP): nf4 base in bf16 storage, bf16 compute."""
    run = run_on_gpu(
        "single_gpu.yaml", demo_assets, tmp_path / "out",
        **{
            "model.dtype": "bfloat16", "peft.r": 8, "peft.target_modules": "[all-linear]", "optim.lr": "1e-3",
            "peft.quantization": "nf4", "output.export_merged": "true", "checkpoint.save_every_steps": 0,
        },
    )  # fmt: skip
    assert "its linear weights in 4 bits (nf4, packed in bfloat16 storage" in run.log
    losses = run.losses()
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert (run.output_dir / "final" / "adapter_model.safetensors").exists()
    reference = load_file(run.output_dir / "final_logits.safetensors")
    merged = reloaded_logits(run.output_dir / "final_merged", reference)
    assert relative_distance(merged, reference["logits"]) < 3e-2
