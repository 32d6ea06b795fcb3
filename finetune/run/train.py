"""`finetune train`: the straight line from a recipe to a trained model.

preflight (finetune.run.build)   checks that need no weights, before a launch's processes load anything
build_run (finetune.run.build)   the run, in named stages: accelerator, tokenizer, model, data, optimizer,
                             checkpoint I/O, objective, restore
claim the output dir         only once everything is built and restored
run_steps (finetune.run.loop)    stepping, logging, evaluating and saving on schedule
report                       each rank's report, the final logits an export must reproduce
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.config import RecipeConfig, save_recipe
from finetune.export.consolidate import FINAL_LOGITS, save_final_logits
from finetune.run.build import build_run, preflight
from finetune.run.loop import run_steps, saves_last_step
from finetune.run.metrics import MetricsLogger
from finetune.run.report import log_setup, write_rank_report
from finetune.storage.checkpoint import checkpoints_root
from finetune.storage.outputs import check_shared_output_dir, claim_output_dir

__all__ = ["TrainResult", "preflight", "train"]


@dataclass(frozen=True)
class TrainResult:
    output_dir: Path
    final_checkpoint: Path | None
    """The checkpoint of the last step, to export from; None when a preemption signal stopped training."""


def train(recipe: RecipeConfig, resume_from: Path | None) -> TrainResult:
    """Run the recipe under the accelerate config this process was launched with, from `resume_from`
    (a checkpoint `preflight` chose) or from the start."""
    run = build_run(recipe, resume_from)
    accelerator, output_dir = run.accelerator, run.output_dir
    # Everything is validated, built and restored: only now is the output dir written to.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        claim_output_dir(output_dir, resumed_step=run.start.step if resume_from else None)
        save_recipe(recipe, output_dir / "recipe.yaml")
        run.write_objective_files()
    check_shared_output_dir(output_dir, accelerator)

    log_setup(run, resume_from)
    metrics = MetricsLogger(
        accelerator, output_dir, run.max_steps, recipe.to_dict(), recipe.output.trackers, run.objective.progress_name
    )
    try:
        data_fingerprint, preempted = run_steps(run, metrics)
        if preempted:
            accelerator.print(f"preempted: checkpoint saved at step {preempted}; resume with checkpoint.resume=auto")
            return TrainResult(output_dir, None)
        write_rank_report(run, data_fingerprint)
        if recipe.output.export:
            save_final_logits(run.model, accelerator, output_dir / FINAL_LOGITS)
    finally:
        metrics.close()  # ends the progress bar, so that an error message starts on its own line
    final = checkpoints_root(output_dir) / f"step_{run.max_steps}"
    return TrainResult(output_dir, final if saves_last_step(recipe) else None)
