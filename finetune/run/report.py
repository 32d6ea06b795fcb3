"""What a run says about itself: the setup lines at its start, and each rank's report at its end."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend

from finetune.config import RecipeConfig
from finetune.engine import attention
from finetune.engine.accelerator import compute_dtype, local_params_fingerprint, shard_report, strategy_name
from finetune.engine.sequence import data_parallel_size, sequence_parallel
from finetune.engine.wrap import format_wrap_plan, fsdp_units
from finetune.model.loading import DTYPES
from finetune.run.build import Run
from finetune.storage.checkpoint import recipe_changes


def log_setup(run: Run, resume_from: Path | None) -> None:
    """The run's setup in the log (main process): strategy, precision, what trains, attention, what the build
    chose, the batch, the data, compilation, the wrap plan and where it resumed from."""
    accelerator, recipe, model = run.accelerator, run.recipe, run.model
    if not accelerator.is_main_process:
        return
    processes = data_parallel_size(accelerator)
    global_batch = recipe.train.micro_batch_size * run.accumulation * processes
    kind = "data-parallel " if processes != accelerator.num_processes else ""  # the rest share rows (sequence groups)
    lines = [
        f"strategy: {strategy_name(accelerator)} on {accelerator.device.type}",
        run.weights.precision_line(accelerator, model),
        run.weights.describe(model),
        attention_line(accelerator, recipe, model),
        *run.choices,
        f"batch: {recipe.train.micro_batch_size} x {run.accumulation} accumulation x "
        f"{processes} {kind}processes = {global_batch} {run.unit_noun} per step, {run.max_steps} steps",
        run.data.train_stats.describe("train data"),
        sequence_line(accelerator, recipe),
    ]
    compiled = sum(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        regional = accelerator.state.dynamo_plugin.use_regional_compilation
        lines.append(
            f"compile: {accelerator.state.dynamo_plugin.backend.value.lower()}, "
            + (f"regional ({compiled} modules compiled in place)" if regional else "the whole model")
        )
    if run.data.eval_stats is not None:
        lines.append(run.data.eval_stats.describe("eval data"))
    if accelerator.distributed_type == DistributedType.FSDP:
        lines.append(format_wrap_plan(fsdp_units(model)))
    if resume_from is not None:
        changes = recipe_changes(resume_from, recipe)
        changed = f", with settings changed since it was saved: {'; '.join(changes)}" if changes else ""
        lines.append(f"resumed from {resume_from}{changed}")
    for line in lines:
        if line is not None:
            accelerator.print(line)


def sequence_line(accelerator: Accelerator, recipe: RecipeConfig) -> str | None:
    """What each process holds of a row under sequence parallelism, and the padding a split adds (None without)."""
    sp = sequence_parallel(accelerator)
    if sp is None:
        return None
    length = recipe.data.max_length
    padded = -length % sp.size
    if recipe.data.packing:
        pad = f"; rows padded from {length:,} to {length + padded:,} tokens to split evenly" if padded else ""
        return f"sequence parallelism: each process holds {(length + padded) // sp.size:,} tokens of every row{pad}"
    return (
        f"sequence parallelism: each process holds 1/{sp.size} of every row (rows padded at their end to a multiple "
        f"of {sp.size} tokens where needed: positions no target reads)"
    )


def attention_line(accelerator: Accelerator, recipe: RecipeConfig, model: torch.nn.Module) -> str:
    implementation = accelerator.unwrap_model(model).config._attn_implementation
    if implementation != attention.NAME:
        packed = " (packed rows: block-causal mask; model.attn_implementation=varlen passes boundaries)"
        return f"attention: {implementation}" + (packed if recipe.data.packing and implementation == "sdpa" else "")
    kernel = attention.kernel(
        accelerator.device, compute_dtype(accelerator.mixed_precision, DTYPES[recipe.model.dtype])
    )
    return f"attention: varlen, packed rows by their sample boundaries ({kernel})"


def write_rank_report(run: Run, data_fingerprint: str) -> None:
    """Per-rank facts for debugging a distributed run: what this rank holds and what data it saw."""
    accelerator = run.accelerator
    report = shard_report(accelerator, run.model)
    report.update(
        steps=run.max_steps,
        data_fingerprint=data_fingerprint,
        params_fingerprint=local_params_fingerprint(run.model),
        started_on_meta_device=run.started_on_meta,
    )
    ranks_dir = run.output_dir / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    (ranks_dir / f"rank_{accelerator.process_index}.json").write_text(json.dumps(report, indent=2))
