"""KTO (`preference.loss: kto`): unpaired samples and pairs split into one desirable and one undesirable sample,
each sample's mismatched partner drawn once (any sampler, micro-batch size or process count gives the same), the
reference point over the whole step, the loss, gradient and metrics of TRL's KTOTrainer on the same tokens; then a
real run (FSDP2, 2 processes) whose step 1 is the loss at the reference, and a resume on 1 process that trains what
2 processes trained."""

from __future__ import annotations

import copy
import json
import shutil

import datasets
import pytest
import torch
from accelerate import Accelerator
from helpers import LaunchedRun, launch, recipe_overrides
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from finetune.config import DataConfig, PreferenceConfig, load_recipe
from finetune.data.tokenize import IGNORE
from finetune.data.unpaired import collate_unpaired, prepare_unpaired
from finetune.errors import FinetuneError
from finetune.objectives.kto import KTO
from finetune.objectives.reference import REFERENCE_FILE

MAX_LENGTH = 128


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets / "base")


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def unpaired(rows: list[dict], tokenizer, seed: int = 0, **settings) -> tuple[list[dict], object]:
    cfg = DataConfig(train_path="unused", max_length=MAX_LENGTH, **settings)
    samples, stats = prepare_unpaired([(None, datasets.Dataset.from_list(rows))], tokenizer, cfg, [""], seed)
    return samples.to_list(), stats


def feedback(n: int) -> list[dict]:
    """n unpaired conversational samples over the demo's task, labelled alternately (a reversal, then a near miss)."""
    rows = []
    for k in range(n):
        digits = [str((k * 7 + j) % 10) for j in range(3 + k % 3)]
        reply = list(reversed(digits)) if k % 2 == 0 else [*reversed(digits[1:]), digits[0]][::-1]
        rows.append({"prompt": [turn("user", "reverse: " + " ".join(digits))],
                     "completion": [turn("assistant", " ".join(reply))], "label": k % 2 == 0})  # fmt: skip
    return rows


def test_each_sample_is_its_prompt_and_completion_as_rendered_with_a_mismatched_partner(tokenizer):
    rows = feedback(9)
    samples, stats = unpaired(rows, tokenizer)
    assert (stats.num_desirable, stats.num_undesirable) == (5, 4)
    for row, sample in zip(rows, samples, strict=True):
        whole = tokenizer.apply_chat_template([*row["prompt"], *row["completion"]], tokenize=True)["input_ids"]
        ids = sample["prompt_ids"] + sample["completion_ids"]
        assert ids == whole[: len(ids)] and sample["label"] == row["label"]
        assert all(t != IGNORE for t in sample["completion_targets"])  # the reply through its end of turn
    # Every completion is some other sample's mismatched one, once: one cycle through the samples.
    partners = [s["kl_completion_ids"] for s in samples]
    assert sorted(map(tuple, partners)) == sorted(tuple(s["completion_ids"]) for s in samples)
    assert all(s["kl_completion_ids"] != s["completion_ids"] for s in samples)
    assert [s["pair_index"] for s in samples] == list(range(9))
    assert unpaired(rows, tokenizer)[0] == samples  # drawn from the data seed: the same every time
    assert unpaired(rows, tokenizer, seed=1)[0] != samples


def test_pairs_are_split_into_a_desirable_and_an_undesirable_sample(tokenizer, demo_assets):
    lines = (demo_assets / "data" / "pairs_eval.jsonl").read_text().splitlines()[:4]
    pairs = [json.loads(line) for line in lines]
    samples, stats = unpaired(pairs, tokenizer)
    assert (stats.num_desirable, stats.num_undesirable) == (4, 4)
    for n, pair in enumerate(pairs):
        for sample, side in ((samples[n], "chosen"), (samples[4 + n], "rejected")):
            conversation = [*pair["prompt"], *pair[side]] if "prompt" in pair else pair[side]
            whole = tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"]
            assert sample["prompt_ids"] + sample["completion_ids"] == whole[: len(sample["prompt_ids"]) + len(
                sample["completion_ids"])] and sample["label"] == (side == "chosen")  # fmt: skip


def test_text_samples_are_the_prompt_then_the_completion_and_one_eos(tokenizer):
    samples, _ = unpaired([{"prompt": "reverse: 1 2", "completion": " 2 1", "label": True},
                           {"prompt": "reverse: 3 4", "completion": " 3 4", "label": False}], tokenizer)  # fmt: skip
    first = samples[0]
    assert first["prompt_ids"] == tokenizer("reverse: 1 2")["input_ids"]
    reply = tokenizer(" 2 1", add_special_tokens=False)["input_ids"]
    assert first["completion_ids"] == reply + [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "a", "completion": "b", "label": "no"}, {"prompt": "c", "completion": "d", "label": "yes"}],
         "sample 0: label must be true .* or false .*, got str 'no'"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": True}],
         "holds desirable samples only .*add undesirable samples"),
        ([{"prompt": "a", "completion": "b", "label": False}], "holds undesirable samples only"),
        ([{"prompt": "a", "completion": "b"}], "KTO data needs completion and label columns"),
        ([{"prompt": [turn("user", "a")], "completion": [turn("user", "b"), turn("assistant", "c")], "label": True}],
         "sample 0: completion goes on after the prompt with a user turn"),
    ],
)  # fmt: skip
def test_bad_samples_are_refused_naming_the_fix(tokenizer, rows, message):
    with pytest.raises(FinetuneError, match=message):
        unpaired(rows, tokenizer)


def test_a_supervised_run_refuses_labelled_feedback(tokenizer):
    from finetune.data.tokenize import tokenize

    data = datasets.Dataset.from_list([{"prompt": "a", "completion": "b", "label": False}])
    with pytest.raises(FinetuneError, match="supervised fine-tuning would train on the undesirable completions"):
        tokenize(data, tokenizer, DataConfig(train_path="unused", max_length=MAX_LENGTH))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["preference.desirable_weight=0"], "preference.desirable_weight must be > 0"),
        (["preference.loss=dpo", "preference.undesirable_weight=1.2"], "undesirable_weight applies to loss: kto, no"),
        (["preference.sft_weight=0.5"], "kto has no pairs; remove it"),
    ],
)
def test_settings_kto_cannot_honour_are_refused(overrides, message):
    with pytest.raises(FinetuneError, match=message):
        load_recipe("recipes/demo/tiny_llama_kto.yaml", overrides)


# ---- TRL's KTOTrainer as the oracle: its tokens, partners, reference point, loss, gradient and metrics.


def test_the_loss_gradient_reference_point_and_metrics_equal_trls_kto_trainer(tokenizer, tmp_path):
    from trl import KTOConfig, KTOTrainer

    rows = feedback(8)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=256)  # fmt: skip
    policy = LlamaForCausalLM(config)
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # the reference moved away from the policy, so that rewards and z0 are not all 0
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    cfg = PreferenceConfig(loss="kto", beta=0.5, desirable_weight=1.0, undesirable_weight=1.25)
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, use_cpu=True, report_to=[], beta=0.5,
                     desirable_weight=1.0, undesirable_weight=1.25, bf16=False, max_length=None,
                     train_sampling_strategy="sequential")  # fmt: skip
    ours, _ = unpaired(rows, tokenizer)
    trainer = KTOTrainer(model=copy.deepcopy(policy), ref_model=reference, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(rows))  # fmt: skip
    trl_rows = trainer.train_dataset.to_list()
    for mine, theirs in zip(ours, trl_rows, strict=True):  # its own tokens are ours
        assert (mine["prompt_ids"], mine["completion_ids"]) == (theirs["prompt_ids"], theirs["completion_ids"])
    # Its partners (completions cycled by one within the batch) given to ours: the same mismatched sequences.
    for mine, theirs in zip(ours, trl_rows, strict=True):
        mine["kl_completion_ids"] = theirs["KL_completion_ids"]
        mine["kl_completion_targets"] = theirs["KL_completion_ids"]
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, trainer.data_collator(trl_rows), return_outputs=False)
    trl_loss.backward()
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert logged["kl"] > 0  # the reference point is not clamped away

    objective = KTO(cfg, "chunked", "model", reference_model=reference)
    batch = collate_unpaired(ours, max_length=MAX_LENGTH, pad_id=tokenizer.pad_token_id, packing=True)
    (batch,) = objective.rollout(policy, [batch], 1, Accelerator(cpu=True))
    assert batch["kl"].item() == pytest.approx(logged["kl"], abs=1e-5)
    total, sums = objective.loss(policy.train(), batch)
    (total / len(ours)).backward()  # the loop divides by the step's samples
    assert total.item() / len(ours) == pytest.approx(trl_loss.item(), abs=1e-6)
    named = dict(trainer.model.named_parameters())
    for name, parameter in policy.named_parameters():
        torch.testing.assert_close(parameter.grad, named[name].grad, atol=1e-6, rtol=1e-4, msg=name)
    metrics = dict(zip(objective.metric_names, sums.tolist(), strict=True))
    for name, kind in (("rewards/chosen", "desirable"), ("rewards/rejected", "undesirable"),
                       ("logps/chosen", "desirable"), ("logps/rejected", "undesirable")):  # fmt: skip
        assert metrics[name] / metrics[kind] == pytest.approx(logged[name], abs=1e-5), name


def test_the_reference_point_is_the_steps_whatever_its_micro_batches(tokenizer):
    """z0 from two micro-batches of 4 equals z0 from one of 8, and so does each sample's loss."""
    samples, _ = unpaired(feedback(8), tokenizer)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=256)  # fmt: skip
    policy = LlamaForCausalLM(config)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    objective = KTO(PreferenceConfig(loss="kto"), "full", "model", reference_model=reference)
    accelerator = Accelerator(cpu=True)

    def collate(rows):
        return collate_unpaired(rows, max_length=MAX_LENGTH, pad_id=tokenizer.pad_token_id, packing=False)

    whole = objective.rollout(policy, [collate(samples)], 1, accelerator)
    halves = objective.rollout(policy, [collate(samples[:4]), collate(samples[4:])], 1, accelerator)
    assert halves[0]["kl"].item() == pytest.approx(whole[0]["kl"].item(), abs=1e-6) and whole[0]["kl"] != 0
    with torch.no_grad():
        one = objective.loss(policy, whole[0])[0]
        two = sum(objective.loss(policy, batch)[0] for batch in halves)
    assert two.item() == pytest.approx(one.item(), abs=1e-5)


# ---- Real runs: FSDP2 over 2 CPU processes, then a resume on 1, sharing the launch between assertions.

RUN = {
    "train.max_steps": 8, "train.micro_batch_size": 4, "train.eval_every_steps": 4, "optim.lr": "1e-4",
    "optim.warmup_steps": 0, "checkpoint.save_every_steps": 4, "checkpoint.keep_last": 2,
}  # fmt: skip


def kto_run(output_dir, assets, model, data, processes=2, **extra) -> LaunchedRun:
    from helpers import REPO

    values = {"model.name_or_path": model, "data.train_path": data / "train.jsonl",
              "data.eval_path": data / "eval.jsonl", **RUN, **extra}  # fmt: skip
    overrides = recipe_overrides(assets, output_dir, **values)
    recipe = REPO / "recipes" / "demo" / "tiny_llama_kto.yaml"
    result = launch("fsdp2_full_shard.yaml", overrides, num_processes=processes, recipe=recipe)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


@pytest.fixture(scope="module")
def feedback_data(tmp_path_factory, demo_assets):
    """The demo's pairs made unpaired (TRL's layout): each chosen reply desirable, each rejected one undesirable; as
    many as the runs read (a precomputed reference scores every sample before step 1)."""
    folder = tmp_path_factory.mktemp("kto-data")
    for name, source, pairs in (("train.jsonl", "pairs_train.jsonl", 64), ("eval.jsonl", "pairs_eval.jsonl", 16)):
        rows = []
        for line in (demo_assets / "data" / source).read_text().splitlines()[:pairs]:
            pair = json.loads(line)
            rows += [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
                     for side in ("chosen", "rejected")]  # fmt: skip
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_assets, partly_trained, feedback_data) -> LaunchedRun:
    """KTO of the partly trained demo model under FSDP2 on 2 processes: 8 steps of 8 samples, reference
    precomputed."""
    return kto_run(tmp_path_factory.mktemp("kto") / "out", demo_assets, partly_trained, feedback_data)


@pytest.mark.multiprocess
def test_a_kto_run_starts_at_the_reference_logs_its_metrics_and_evaluates(run):
    metrics = run.metrics()
    steps = {m["step"]: m for m in metrics if "loss" in m}
    assert sorted(steps) == list(range(1, 9)) and steps[1]["samples"] == 8
    # Step 1: the policy is the reference, so every reward and z0 are 0 and each loss is weight x (1 - sigmoid 0),
    # within rounding: the reference scored each sample in other micro-batches (in the data's order), other rows.
    assert steps[1]["loss"] == pytest.approx(0.5, abs=1e-6) and steps[1]["kl"] == pytest.approx(0, abs=1e-6)
    assert steps[1]["rewards/chosen"] == pytest.approx(0, abs=1e-6) and abs(steps[8]["rewards/chosen"]) > 1e-4
    # Each step logs the fractions of its samples of either label; the run trained on both.
    assert all(m["desirable"] + m["undesirable"] == pytest.approx(1) for m in steps.values())
    assert 0 < sum(m["desirable"] for m in steps.values()) / len(steps) < 1
    evaluated = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evaluated] == [4, 8]
    assert all(f"eval_{name}" in evaluated[-1] for name in ("kl", "rewards/margins", "rewards/chosen"))
    assert "samples precomputed with the initial weights" in run.log


@pytest.mark.multiprocess
def test_a_resume_on_one_process_trains_what_two_processes_trained(
    run, demo_assets, partly_trained, feedback_data, tmp_path
):
    """Elastic resume, and with it 1 process = 2: the step-4 checkpoint (2 processes x 4 samples) resumed on 1
    process x 8 samples gives steps 5-8's losses and reference points (each over the whole step) as logged."""
    output_dir = tmp_path / "out"
    shutil.copytree(run.output_dir / "checkpoints" / "step_4", output_dir / "checkpoints" / "step_4")
    shutil.copy(run.output_dir / REFERENCE_FILE, output_dir / REFERENCE_FILE)
    resumed = kto_run(output_dir, demo_assets, partly_trained, feedback_data, processes=1, **{
        "checkpoint.resume": "auto", "train.micro_batch_size": 8, "train.eval_every_steps": 0,
        "checkpoint.save_every_steps": 0,
    })  # fmt: skip
    expected = {m["step"]: m for m in run.metrics() if "loss" in m}
    losses = {m["step"]: m for m in resumed.metrics() if "loss" in m}
    assert sorted(losses) == [5, 6, 7, 8]
    for step, logged in losses.items():
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
            assert logged[key] == pytest.approx(expected[step][key], abs=1e-5), (step, key)
    assert "precomputed with the initial weights" not in resumed.log  # read, never recomputed from trained weights
