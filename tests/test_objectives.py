"""The objective seam: an objective the tests define (tests/custom_objective.py) trains through the real loop, build,
metrics and checkpoints, none of which knows it, chosen by `train.objective`."""

from __future__ import annotations

import json

import pytest
import torch
from custom_objective import WeightedTokens, eos_heavy
from helpers import DEMO_RECIPE, LaunchedRun, launched_run, recipe_overrides

from finetune.config import load_recipe
from finetune.data import IGNORE
from finetune.errors import FinetuneError
from finetune.run.build import preflight


@pytest.fixture(scope="module")
def custom_objective_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """fsdp2_run's launch, with every target token weighted 1 by an objective of the tests' own."""
    objective = {"train.objective": "tests.custom_objective:uniform", "output.trackers": "[tensorboard]"}
    return launched_run(tmp_path_factory, demo_assets, "custom", "fsdp2_full_shard.yaml", **objective)


def test_an_objective_of_its_own_trains_through_the_loop_as_the_built_in_one(custom_objective_run, fsdp2_run):
    ours, theirs = custom_objective_run.metrics(), fsdp2_run.metrics()
    # Its unit (the weights, all 1) is supervised fine-tuning's target tokens; its loss, through the full logits,
    # that of the chunked path: the same normalization, accumulation and reduction over processes.
    assert [m["token_weight"] for m in ours if "loss" in m] == [m["target_tokens"] for m in theirs if "loss" in m]
    torch.testing.assert_close(custom_objective_run.losses(), fsdp2_run.losses(), rtol=1e-4, atol=1e-5)
    evaluated = [m["eval_loss"] for m in ours if "eval_loss" in m]
    assert len(evaluated) == 2  # its own evaluation, at steps 8 and 16
    torch.testing.assert_close(evaluated, [m["eval_loss"] for m in theirs if "eval_loss" in m], rtol=1e-4, atol=1e-5)
    assert all(m["eos_loss"] > 0 for m in ours if "loss" in m)  # its metric, logged per step
    assert "= 16 sequences per step" in custom_objective_run.log


def test_its_checkpoints_name_it_and_resume_only_under_it(custom_objective_run, demo_assets):
    checkpoint = custom_objective_run.output_dir / "checkpoints" / "step_16"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["objective"] == "weighted_tokens"
    resume = recipe_overrides(demo_assets, custom_objective_run.output_dir, **{"checkpoint.resume": "auto",
                                                                              "train.max_steps": 20})  # fmt: skip
    with pytest.raises(FinetuneError, match="is of a weighted_tokens run, and this recipe trains supervised; to"):
        preflight(load_recipe(DEMO_RECIPE, resume))
    preflight(load_recipe(DEMO_RECIPE, [*resume, "train.objective=tests.custom_objective:uniform"]))


def test_the_weighted_loss_weighs_each_target_token(demo_assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_assets / "base")
    objective = WeightedTokens(3.0, model.config.eos_token_id)
    assert eos_heavy(None).eos_weight == 3.0
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    targets = torch.tensor([[IGNORE, 7, 8, 9, 10, model.config.eos_token_id]])
    batch = {"input_ids": input_ids, "target_ids": targets}
    summed, sums = objective.loss(model, batch)
    losses = torch.nn.functional.cross_entropy(model(input_ids).logits[0], targets[0], reduction="none",
                                               ignore_index=IGNORE)  # fmt: skip
    weights = torch.tensor([0, 1, 1, 1, 1, 3.0])
    torch.testing.assert_close(summed, (losses * weights).sum())
    torch.testing.assert_close(sums, (3 * losses[-1]).reshape(1))
    assert objective.count(batch).item() == 7


def test_an_objective_that_cannot_be_imported_is_refused_naming_the_fix(demo_assets, tmp_path):
    overrides = recipe_overrides(demo_assets, tmp_path / "out", **{"train.objective": "tests.no_such_module:x"})
    with pytest.raises(FinetuneError, match="train.objective=tests.no_such_module:x cannot be imported"):
        preflight(load_recipe(DEMO_RECIPE, overrides))
    with pytest.raises(FinetuneError, match="train.objective=not-a-name is not module:attribute"):
        load_recipe(DEMO_RECIPE, ["train.objective=not-a-name"])
