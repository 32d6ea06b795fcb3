"""Reward models (`reward_model:`): the base as a scalar sequence classifier whose head starts at zero, each score read
at the last token of the conversation as the template renders it whole (packed or padded, the same number), the
loss, gradient and metrics of TRL's RewardTrainer on the same tokens; then real runs (FSDP2, 2 processes): ln 2 at
step 1 with the data's margins, 1 = 2 processes, exact resume, and an export that transformers' classifier and its
pipeline score as finetune does."""

from __future__ import annotations

import copy
import json
import math
import shutil

import datasets
import pytest
import torch
from helpers import LaunchedRun, launch, recipe_overrides
from transformers import AutoTokenizer

from finetune.config import DataConfig, ModelConfig, RewardModelConfig, load_recipe
from finetune.data.preference import collate_pairs, prepare_pairs
from finetune.errors import FinetuneError
from finetune.model.loading import load_model
from finetune.objectives.reward_model import RewardModel, sequence_scores

MAX_LENGTH = 128


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets / "base")


@pytest.fixture(scope="module")
def eval_pairs(demo_assets) -> list[dict]:
    lines = (demo_assets / "data" / "pairs_eval.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def scored(rows: list[dict], tokenizer, **settings) -> list[dict]:
    """The pairs as a reward model tokenizes them."""
    cfg = DataConfig(train_path="unused", max_length=MAX_LENGTH, **settings)
    pairs, _ = prepare_pairs([(None, datasets.Dataset.from_list(rows))], tokenizer, cfg, [""], whole=True)
    return pairs.to_list()


def rendered(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]


def reward_model(demo_assets, tokenizer) -> torch.nn.Module:
    return load_model(ModelConfig(name_or_path=str(demo_assets / "base")), "none", score_pad_id=tokenizer.pad_token_id)


def test_the_base_becomes_a_scalar_classifier_whose_head_starts_at_zero(demo_assets, tokenizer, capfd):
    model = reward_model(demo_assets, tokenizer)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.architectures == ["LlamaForSequenceClassification"]
    assert (model.config.num_labels, model.config.problem_type) == (1, "regression")  # read raw by every reader
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    assert torch.count_nonzero(model.score.weight) == 0
    assert "LOAD REPORT" not in "".join(capfd.readouterr())  # the new head and the unused lm_head are expected


def test_each_score_is_read_at_the_last_token_of_the_whole_rendering_packed_or_padded(
    demo_assets, tokenizer, eval_pairs
):
    torch.manual_seed(0)
    model = reward_model(demo_assets, tokenizer).eval()
    torch.nn.init.normal_(model.score.weight, std=0.5)
    rows = eval_pairs[:5]
    pairs = scored(rows, tokenizer)
    for row, pair in zip(rows, pairs, strict=True):  # exactly what apply_chat_template gives every reader
        for side in ("chosen", "rejected"):
            assert pair[f"{side}_ids"] == rendered(tokenizer, row["prompt"] + row[side])
    alone = [model(input_ids=torch.tensor([pair[f"{side}_ids"]])).logits[0, 0].item()
             for side in ("chosen", "rejected") for pair in pairs]  # fmt: skip
    with torch.no_grad():
        for packing in (True, False):
            batch = collate_pairs(pairs, max_length=MAX_LENGTH, pad_id=tokenizer.pad_token_id, packing=packing)
            assert sequence_scores(model, batch).tolist() == pytest.approx(alone, abs=1e-5)


def test_a_template_that_writes_after_the_reply_is_scored_at_its_last_token(tokenizer, eval_pairs):
    """Qwen's template ends a turn with <|im_end|> and a newline: the newline is where the score is read, as
    readers that render the conversation read it, and it is not a compared token."""
    newline = copy.deepcopy(tokenizer)
    newline.chat_template = tokenizer.chat_template.replace("<|end|>", "<|end|>\n")
    (pair,) = scored(eval_pairs[:1], newline)
    ids = rendered(newline, eval_pairs[0]["prompt"] + eval_pairs[0]["chosen"])
    assert pair["chosen_ids"] == ids and newline.decode(ids[-2:]) == "<|end|>\n"
    assert pair["chosen_targets"][-2:] == [-100, -100]  # the <|end|> is the last compared token, predicted before it


def test_the_loss_gradient_accuracy_and_margin_equal_trls_reward_trainer(demo_assets, tokenizer, eval_pairs, tmp_path):
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(0)
    ours = reward_model(demo_assets, tokenizer)
    torch.nn.init.normal_(ours.score.weight, std=0.5)
    rows = [
        {**row, "margin": margin} for row, margin in zip(eval_pairs, [0.0, 0.5, -1.0, 2.0, 0.0, 1.5], strict=False)
    ]
    pairs = scored(rows, tokenizer)
    args = RewardConfig(output_dir=str(tmp_path), report_to=[], center_rewards_coefficient=0.01, use_cpu=True,
                        bf16=False, per_device_train_batch_size=6)  # fmt: skip
    trainer = RewardTrainer(model=copy.deepcopy(ours), args=args, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list(rows))  # fmt: skip
    for trl_row, pair in zip(trainer.train_dataset, pairs, strict=True):  # its own tokens are ours
        assert (trl_row["chosen_ids"], trl_row["rejected_ids"]) == (pair["chosen_ids"], pair["rejected_ids"])
    trainer.model.train()
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(pairs))
    theirs.backward()
    objective = RewardModel(RewardModelConfig(center_rewards_coefficient=0.01))
    batch = collate_pairs(pairs, max_length=MAX_LENGTH, pad_id=tokenizer.pad_token_id, packing=True)
    total, sums = objective.loss(ours.train(), batch)
    (total / len(pairs)).backward()  # the loop divides by the step's pairs
    assert total.item() / len(pairs) == pytest.approx(theirs.item(), abs=1e-6)
    named = dict(trainer.model.named_parameters())
    for name, parameter in ours.named_parameters():
        torch.testing.assert_close(parameter.grad, named[name].grad, atol=1e-5, rtol=1e-4, msg=name)  # fp32 sums
    logged = trainer._metrics["train"]
    chosen, rejected, margins, accuracies = (sums / len(pairs)).tolist()
    assert accuracies == logged["accuracy"][-1] and margins == pytest.approx(logged["margin"][-1], abs=1e-5)
    assert (chosen + rejected) / 2 == pytest.approx(logged["mean_reward"][-1], abs=1e-5)


def test_a_margin_that_is_not_a_number_names_the_sample(tokenizer, eval_pairs):
    rows = [{**row, "margin": margin} for row, margin in zip(eval_pairs, [1.0, None], strict=False)]
    with pytest.raises(FinetuneError, match=r"sample 1: margin must be a number, got .*; fix or remove it"):
        scored(rows, tokenizer)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward_model.center_rewards_coefficient=-0.1"], "reward_model.center_rewards_coefficient must be >= 0"),
        (["preference.loss=dpo"], "a reward_model section trains by its own objective; remove preference"),
        (["data.packing_window=100"], "a reward_model run packs each micro-batch's pairs together"),
        (["data.completion_only_loss=false"], "compares the scores of the two replies to one prompt"),
        (["data.format=chat"], "a reward_model section trains on pairs, not data.format=chat"),
    ],
)
def test_settings_a_reward_model_cannot_honour_are_refused(overrides, message):
    recipe = "recipes/demo/tiny_llama_reward.yaml"
    with pytest.raises(FinetuneError, match=message):
        load_recipe(recipe, overrides)


# ---- Real runs: 2 CPU processes through accelerate launch, sharing launches between assertions.

MARGIN = 0.5
RUN = {
    "train.max_steps": 8, "train.micro_batch_size": 4, "train.eval_every_steps": 4, "optim.lr": "1e-3",
    "optim.warmup_steps": 0, "checkpoint.save_every_steps": 4, "checkpoint.keep_last": 2,
}  # fmt: skip


def reward_run(tmp_path, assets, data, processes=2, **extra) -> LaunchedRun:
    output_dir = tmp_path / "out"
    values = {"data.train_path": data / "train.jsonl", "data.eval_path": data / "eval.jsonl", **RUN, **extra}
    overrides = recipe_overrides(assets, output_dir, **values)
    result = launch("fsdp2_full_shard.yaml", overrides, num_processes=processes, recipe=_recipe())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


def _recipe():
    from helpers import REPO

    return REPO / "recipes" / "demo" / "tiny_llama_reward.yaml"


@pytest.fixture(scope="module")
def margin_pairs(tmp_path_factory, demo_assets):
    """The demo's pairs with a margin column (TRL's layout): every chosen reply must lead by MARGIN."""
    folder = tmp_path_factory.mktemp("reward-data")
    for name, source in (("train.jsonl", "pairs_train.jsonl"), ("eval.jsonl", "pairs_eval.jsonl")):
        rows = [json.loads(line) for line in (demo_assets / "data" / source).read_text().splitlines()]
        (folder / name).write_text("".join(json.dumps({**row, "margin": MARGIN}) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory, demo_assets, margin_pairs) -> LaunchedRun:
    """A reward model of the demo's base under FSDP2 on 2 processes: packed pairs, 8 steps of 8 pairs."""
    return reward_run(tmp_path_factory.mktemp("rm"), demo_assets, margin_pairs)


@pytest.mark.multiprocess
def test_a_reward_model_starts_at_the_margins_loss_logs_its_metrics_and_evaluates(rm_run):
    metrics = rm_run.metrics()
    losses = {m["step"]: m for m in metrics if "loss" in m}
    assert sorted(losses) == list(range(1, 9)) and losses[1]["pairs"] == 8
    # Every score 0 at step 1: each pair's loss is -log sigmoid(-margin), ln 2 without one.
    assert losses[1]["loss"] == pytest.approx(math.log1p(math.exp(MARGIN)), abs=1e-6)
    assert losses[1]["rewards/margins"] == 0.0 and losses[8]["rewards/margins"] != 0.0
    evaluated = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evaluated] == [4, 8]
    assert all(name in evaluated[-1] for name in ("eval_rewards/accuracies", "eval_rewards/chosen"))
    assert "scores: the scalar head at each sequence's last token" in rm_run.log


@pytest.mark.multiprocess
def test_the_export_scores_the_same_in_transformers_its_pipeline_and_finetune(rm_run, tokenizer, eval_pairs):
    """A standard sequence-classification folder: AutoModelForSequenceClassification and the text-classification
    pipeline (its default call: no sigmoid, as problem_type is regression) give finetune's scores, within 1e-5,
    given the same tokens (the template writes the BOS: the pipeline is called with add_special_tokens=False)."""
    from transformers import AutoModelForSequenceClassification, pipeline

    folder = rm_run.output_dir / "final"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["problem_type"] == "regression"
    assert config["pad_token_id"] == tokenizer.pad_token_id and len(config["id2label"]) == 1
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    rows = eval_pairs[:16]
    pairs = scored(rows, tokenizer)
    batch = collate_pairs(pairs, max_length=MAX_LENGTH, pad_id=tokenizer.pad_token_id, packing=True)
    with torch.no_grad():
        ours = sequence_scores(model, batch).tolist()
        texts = [tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=False)
                 for side in ("chosen", "rejected") for row in rows]  # fmt: skip
        padded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        classified = model(**padded).logits[:, 0].tolist()
    scorer = pipeline("text-classification", model=str(folder), device="cpu")
    piped = [result["score"] for result in scorer(texts, add_special_tokens=False, batch_size=4)]
    assert classified == pytest.approx(ours, abs=1e-5)
    assert piped == pytest.approx(ours, abs=1e-5)
    assert any(score < 0 for score in ours)  # raw scores: a sigmoid would make every one positive


@pytest.mark.multiprocess
def test_a_resume_on_one_process_trains_what_two_processes_trained(rm_run, demo_assets, margin_pairs, tmp_path):
    """The fixture's step-4 checkpoint (2 processes x 4 pairs) resumed on 1 process x 8 pairs: steps 5 to 8 as
    the fixture logged them (one launch proves elastic resume and 1 = 2 processes)."""
    output_dir = tmp_path / "out"
    shutil.copytree(rm_run.output_dir / "checkpoints" / "step_4", output_dir / "checkpoints" / "step_4")
    resumed = reward_run(tmp_path, demo_assets, margin_pairs, processes=1, **{
        "checkpoint.resume": "auto", "train.micro_batch_size": 8, "train.eval_every_steps": 0,
        "checkpoint.save_every_steps": 0,
    })  # fmt: skip
    expected = {m["step"]: m for m in rm_run.metrics() if "loss" in m}
    losses = {m["step"]: m for m in resumed.metrics() if "loss" in m}
    assert sorted(losses) == [5, 6, 7, 8]
    for step, logged in losses.items():
        for key in ("loss", "rewards/margins", "rewards/accuracies"):
            assert logged[key] == pytest.approx(expected[step][key], abs=1e-5), (step, key)


@pytest.fixture(scope="module")
def lora_rm_run(tmp_path_factory, demo_assets, margin_pairs) -> LaunchedRun:
    """A LoRA reward model on 2 processes, exported as its adapter folder and merged."""
    return reward_run(tmp_path_factory.mktemp("lora-rm"), demo_assets, margin_pairs, **{
        "peft.r": 4, "train.max_steps": 4, "train.eval_every_steps": 0, "checkpoint.save_every_steps": 0,
        "optim.lr": "5e-3", "output.export_merged": "true",
    })  # fmt: skip


@pytest.mark.multiprocess
def test_a_lora_reward_model_trains_and_saves_its_head_and_peft_scores_as_the_merged_folder(
    lora_rm_run, tokenizer, eval_pairs
):
    """The head is trained in full beside the adapters and saved with them (not left at its start); PEFT loads the
    adapter folder as a sequence classifier, and it scores as the merged folder and finetune's scorer do."""
    from peft import AutoPeftModelForSequenceClassification
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    adapter, merged = lora_rm_run.output_dir / "final", lora_rm_run.output_dir / "final_merged"
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    head = load_file(adapter / "adapter_model.safetensors")["base_model.model.score.weight"]
    assert torch.count_nonzero(head) == head.numel()  # moved from zero by training
    pairs = scored(eval_pairs[:8], tokenizer)
    batch = collate_pairs(pairs, max_length=MAX_LENGTH, pad_id=tokenizer.pad_token_id, packing=True)
    with torch.no_grad():
        peft_model = AutoPeftModelForSequenceClassification.from_pretrained(
            adapter, num_labels=1, pad_token_id=tokenizer.pad_token_id
        ).eval()
        folded = AutoModelForSequenceClassification.from_pretrained(merged).eval()
        through_peft, ours = sequence_scores(peft_model, batch), sequence_scores(folded, batch)
        alone = folded(input_ids=torch.tensor([pairs[0]["chosen_ids"]])).logits[0, 0]
    torch.testing.assert_close(through_peft, ours, atol=1e-5, rtol=0)
    assert alone.item() == pytest.approx(ours[0].item(), abs=1e-5) and not torch.all(ours == 0)


def test_a_tokenizer_that_pads_with_its_eos_pads_a_reward_model_with_another_token(tokenizer, tmp_path):
    """A scored sequence may end with the EOS, where transformers' classifiers would then not read it: the BOS (or
    the unknown token) pads instead, and the export's tokenizer says so; with neither, the run is refused."""
    from finetune.export.model_files import write_pad_token
    from finetune.model.score_head import score_pad_id

    eos_padded = copy.deepcopy(tokenizer)
    eos_padded.pad_token = eos_padded.eos_token
    assert score_pad_id(tokenizer, "base") == tokenizer.pad_token_id  # a pad of its own stays
    assert score_pad_id(eos_padded, "base") == tokenizer.bos_token_id
    eos_padded.save_pretrained(tmp_path)
    write_pad_token(tmp_path, tokenizer.bos_token)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id == tokenizer.bos_token_id
    eos_padded.bos_token = None
    with pytest.raises(FinetuneError, match="pads with its EOS token and has no BOS or unknown token"):
        score_pad_id(eos_padded, "base")


def test_the_plan_counts_the_score_head_not_the_causal_lms(demo_assets):
    from finetune.plan.shape import planned_model

    recipe = load_recipe(_recipe(), [f"model.name_or_path={demo_assets / 'base'}"])
    names = {name for name, _ in planned_model(recipe).named_parameters()}
    assert "score.weight" in names and not any(name.startswith("lm_head") for name in names)
