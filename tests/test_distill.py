"""Distillation (`distill:`): the divergences against TRL's GKDTrainer, the chunked path against full logits, the
prompts an on-policy step completes, the settings refused, the plan, and a real run on 2 processes resumed on 1 (the
same completions and weights)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import DISTILL_RECIPE, LaunchedRun, launch
from safetensors.torch import load_file

from finetune.config import ConfigError, load_recipe
from finetune.data.pack import collate_packed
from finetune.data.rollout import reply_prompts
from finetune.engine.batch import IGNORE
from finetune.errors import FinetuneError
from finetune.objectives.distill import on_policy
from finetune.objectives.divergence import (
    Spec,
    distill_losses,
    sampled_reverse_kl,
    sampled_token_losses,
    token_divergence,
)

# ---- The loss against TRL's GKDTrainer.generalized_jsd_loss, on the same logits.


@pytest.mark.parametrize(
    ("divergence", "beta"), [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5), ("jsd", 0.1)]
)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_each_divergence_and_its_gradient_equal_trl_gkd(divergence, beta, temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    torch.manual_seed(0)
    student = (torch.randn(3, 5, 40) * 3).requires_grad_()
    teacher = torch.randn(3, 5, 40) * 3
    labels = torch.randint(0, 40, (3, 5))
    labels[0, :2] = labels[2, 4] = IGNORE
    expected = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
    (expected_grad,) = torch.autograd.grad(expected, student)
    kept = labels != IGNORE
    spec = Spec(divergence, beta if divergence == "jsd" else 0.5, temperature)
    ours = token_divergence(student[kept], teacher[kept], spec)
    assert ours.shape == (int(kept.sum()),) and (ours >= 0).all()
    mean = ours.sum() / kept.sum()
    (grad,) = torch.autograd.grad(mean, student)
    torch.testing.assert_close(mean, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def _tiny(seed: int, hidden: int, layers: int, vocab: int = 48):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _packed_batch(vocab: int = 48) -> dict[str, torch.Tensor]:
    """Two rows of packed samples (prompt tokens untrained, replies trained), the second row padded."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for lengths in ((7, 9), (11,)):
        ids, targets, positions = [], [], []
        for length in lengths:
            sample = torch.randint(3, vocab, (length,), generator=generator).tolist()
            ids += sample
            targets += [IGNORE] * 3 + sample[4:] + [IGNORE]  # the reply: from the 5th token on
            positions += list(range(length))
        padding = 16 - len(ids)
        rows.append({"input_ids": ids + [0] * padding, "target_ids": targets + [IGNORE] * padding,
                     "position_ids": positions + [0] * padding, "num_tokens": len(ids)})  # fmt: skip
    return collate_packed(rows)


@pytest.mark.parametrize(("divergence", "sft_weight"), [("forward_kl", 0.0), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_the_chunked_path_equals_full_logits_in_loss_and_gradients(monkeypatch, divergence, sft_weight):
    """A chunk of 2 rows at a time (patched), against both models' logits whole: the same token losses and the same
    gradients of every student parameter; the teacher gets none."""
    import finetune.objectives.divergence

    monkeypatch.setattr(finetune.objectives.divergence, "chunk_rows", lambda vocab, device: 8)
    teacher, student = _tiny(0, 32, 3), _tiny(1, 16, 2)
    teacher.requires_grad_(False)
    batch = _packed_batch()
    spec = Spec(divergence, 0.4, 1.5, sft_weight)
    results = {}
    for path in ("full_logits", "chunked"):
        student.zero_grad()
        losses = distill_losses(student, teacher, batch, path, spec)
        losses.total.backward()
        grads = {name: p.grad.clone() for name, p in student.named_parameters()}
        results[path] = (losses, grads)
    (full, full_grads), (chunked, chunked_grads) = results["full_logits"], results["chunked"]
    assert full.divergence.shape == (int((batch["target_ids"] != IGNORE).sum()),)
    torch.testing.assert_close(chunked.total, full.total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.divergence, full.divergence, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.cross_entropy, full.cross_entropy, rtol=1e-5, atol=1e-6)
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("path", ["full_logits", "chunked"])
def test_the_sampled_estimator_equals_its_reference_from_both_models_logits(monkeypatch, path):
    """distill.estimator: sampled, on either path (chunks of 8 rows), against a reference written from both models'
    whole logits at temperature 1.5: the loss is the sum of log q(x) - log p(x) at the trained tokens, and its
    gradient that of sum (log q(x) - log p(x)) x log q(x) with the first factor constant (the policy gradient); the
    teacher gets none. The Distill objective trains by it and reports its one metric."""
    import finetune.objectives.loss
    from finetune.config import DistillConfig
    from finetune.objectives.distill import Distill
    from finetune.objectives.loss import model_inputs

    monkeypatch.setattr(finetune.objectives.loss, "chunk_rows", lambda vocab, device: 8)
    teacher, student = _tiny(0, 32, 3), _tiny(1, 16, 2)
    teacher.requires_grad_(False)
    batch, temperature = _packed_batch(), 1.5
    kept = batch["target_ids"].reshape(-1) != IGNORE
    targets = batch["target_ids"].reshape(-1)[kept]

    def logps(model):
        logits = model(**model_inputs(model, batch), use_cache=False).logits.flatten(0, 1)[kept]  # samples apart
        return torch.log_softmax(logits / temperature, dim=-1).gather(1, targets[:, None]).squeeze(1)

    with torch.no_grad():
        teacher_logps = logps(teacher)
    student_logps = logps(student)
    estimates = (student_logps - teacher_logps).detach()
    (estimates * student_logps).sum().backward()
    expected = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()

    losses = sampled_reverse_kl(student, teacher, batch, path, Spec("reverse_kl", 0.5, temperature))
    losses.total.backward()
    torch.testing.assert_close(losses.divergence, estimates, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses.total, estimates.sum(), rtol=1e-5, atol=1e-6)
    for name, p in student.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is None for p in teacher.parameters())

    cfg = DistillConfig(teacher="t", divergence="reverse_kl", temperature=temperature, on_policy_fraction=1,
                        max_new_tokens=4, estimator="sampled")  # fmt: skip
    total, metrics = Distill(cfg, path, teacher, None, 0, 16).loss(student, batch)
    torch.testing.assert_close(total, estimates.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics, estimates.sum().reshape(1), rtol=1e-5, atol=1e-6)


def test_the_sampled_estimate_and_its_gradient_have_the_reverse_kl_s_expectation():
    """Seeded Monte Carlo: 200,000 tokens drawn from the student's distribution at each of 3 positions; the mean
    estimate is KL(q || p) and the mean gradient the gradient of KL(q || p) (with respect to the student's logits),
    to within a few standard errors."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, generator=generator, dtype=torch.float64).requires_grad_()
    teacher = torch.randn(3, 7, generator=generator, dtype=torch.float64) * 2
    draws = 200_000
    exact = _reverse_kl(student, teacher)
    (exact_grad,) = torch.autograd.grad(exact.sum(), student)
    log_q = torch.log_softmax(student, dim=-1)
    tokens = torch.multinomial(log_q.exp().detach(), draws, replacement=True, generator=generator)  # (3, draws)
    total, estimates = sampled_token_losses(log_q.gather(1, tokens), torch.log_softmax(teacher, -1).gather(1, tokens))
    (grad,) = torch.autograd.grad(total / draws, student)
    torch.testing.assert_close(estimates.mean(dim=1), exact.detach(), rtol=0, atol=0.02)
    torch.testing.assert_close(grad, exact_grad, rtol=0, atol=0.02)
    assert exact.min() > 0.1  # the two differ: an estimate of 0 would not pass


def _reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    log_q, log_p = torch.log_softmax(student, dim=-1), torch.log_softmax(teacher, dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum(dim=-1)


def test_a_lora_student_trains_its_adapters_alone_on_the_chunked_path():
    from peft import LoraConfig, get_peft_model

    teacher, student = _tiny(0, 32, 3), _tiny(1, 16, 2)
    teacher.requires_grad_(False)
    student = get_peft_model(student, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = _packed_batch()
    spec = Spec("reverse_kl", 0.5, 1.0)
    chunked = distill_losses(student, teacher, batch, "chunked", spec)
    chunked.total.backward()
    trained = {name for name, p in student.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in name for name in trained)
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()
    full = distill_losses(student, teacher, batch, "full_logits", spec)
    full.total.backward()
    torch.testing.assert_close(chunked.total, full.total, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(student.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)


# ---- The teacher's top-k table (distill.teacher_top_k): computed once, looked up by row.


@pytest.mark.parametrize("path", ["full_logits", "chunked"])
def test_a_table_of_the_whole_vocabulary_teaches_as_the_teacher_itself_and_a_top_k_over_its_tokens(path):
    """With k the vocabulary, the table's divergence, cross-entropy and every student gradient are the live
    teacher's; with k=5, the divergence is over the teacher's 5 likeliest tokens, both distributions renormalized
    on them (computed here from both models' whole logits)."""
    from finetune.objectives.loss import model_inputs
    from finetune.objectives.teacher_table import teacher_top_k

    teacher, student = _tiny(0, 32, 3), _tiny(1, 16, 2)
    teacher.requires_grad_(False)
    batch = _packed_batch()
    spec = Spec("jsd", 0.3, 1.5, 0.2)

    def losses_and_grads(grader):
        student.zero_grad()
        losses = distill_losses(student, grader, batch, path, spec)
        losses.total.backward()
        return losses, {name: p.grad.clone() for name, p in student.named_parameters()}

    (live, live_grads), (table, table_grads) = map(losses_and_grads, (teacher, teacher_top_k(teacher, batch, 48)))
    torch.testing.assert_close(table.divergence, live.divergence, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table.cross_entropy, live.cross_entropy)
    for name, grad in live_grads.items():
        torch.testing.assert_close(table_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    top = teacher_top_k(teacher, batch, 5)
    kept = batch["target_ids"].reshape(-1) != IGNORE
    with torch.no_grad():
        teacher_logits, student_logits = (
            m(**model_inputs(m, batch), use_cache=False).logits for m in (teacher, student)
        )
    ids = teacher_logits.flatten(0, 1)[kept].topk(5).indices
    assert torch.equal(top.ids, ids)
    expected = token_divergence(student_logits.flatten(0, 1)[kept].gather(-1, ids), teacher_logits.flatten(0, 1)[kept]
                                .gather(-1, ids), spec)  # fmt: skip
    torch.testing.assert_close(losses_and_grads(top)[0].divergence, expected, rtol=1e-5, atol=1e-6)


def _numbered_rows(first: int):
    import datasets

    batch = _packed_batch()
    rows = [{"input_ids": batch["input_ids"][r].tolist(), "target_ids": batch["target_ids"][r].tolist(),
             "position_ids": batch["position_ids"][r].tolist(), "num_tokens": int(batch["row_tokens"][r])}
            for r in (1, 0, 1)]  # fmt: skip
    return datasets.Dataset.from_list(rows).add_column("row_index", [first, first + 1, first + 2])


def test_the_table_is_stored_under_its_key_read_back_by_row_and_never_read_for_another(tmp_path):
    """Two splits (train and eval, numbered in one range) into one table: each row's entries are its own, looked up
    by row in any order; a folder holding another key (another teacher, other rows, another k) is not read."""
    import functools

    from accelerate import Accelerator

    from finetune.data import _with_row_index
    from finetune.objectives.teacher_table import compute_table, read_table, table_folder, table_key, teacher_top_k

    teacher = _tiny(0, 32, 3)
    teacher.requires_grad_(False)
    splits = [_numbered_rows(0), _numbered_rows(3)]
    collate = functools.partial(_with_row_index, collate_packed)
    assert table_key("teacher-a", splits, "no:float32", 4) != table_key("teacher-b", splits, "no:float32", 4)
    key = table_key("teacher-a", splits, "no:float32", 4)
    folder = table_folder(splits, key, 4, tmp_path)  # data in memory: the output folder
    assert folder.parent == tmp_path and read_table(folder, key) is None
    table = compute_table(teacher, splits, collate, Accelerator(cpu=True), 2, 4, folder, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no partial folder left
    assert table.ids.shape == (2 * (7 + 8 + 7), 4)  # each split: rows 1, 0, 1 of the packed batch (7, 8, 7 trained)
    batch = collate(splits[1].select([2, 0]).to_list())
    looked_up, computed = table.lookup(batch["row_index"], torch.device("cpu")), teacher_top_k(teacher, batch, 4)
    assert torch.equal(looked_up.ids, computed.ids.long())
    torch.testing.assert_close(looked_up.logps, computed.logps)
    assert read_table(folder, key).logps.tolist() == table.logps.tolist()
    assert read_table(folder, table_key("teacher-b", splits, "no:float32", 4)) is None
    with pytest.raises(FinetuneError, match="teacher_top_k=49 is more than the teacher's 48 tokens"):
        compute_table(teacher, splits, collate, Accelerator(cpu=True), 2, 49, folder, key)


def test_two_runs_computing_one_table_at_once_each_write_their_own_and_both_read_a_whole_one(tmp_path):
    """A sweep's runs computing the same table at once: each fills a partial folder of its own (none removes or
    writes into the other's), the first to finish renames it into place, the second finds it there and gives way,
    and both read a whole table."""
    import numpy

    from finetune.objectives.teacher_table import _Writer, read_table

    folder, offsets = tmp_path / "teacher-top2-k", numpy.array([0, 2, 3])
    first, second = _Writer(folder, 3, 2), _Writer(folder, 3, 2)  # both started before either finished
    assert first.partial != second.partial
    for writer in (first, second):
        writer.write(numpy.array([0, 1, 2]), numpy.array([[1, 2], [3, 4], [5, 6]]), numpy.ones((3, 2)))
    second.close(offsets, "k")
    first.close(offsets, "k")
    table = read_table(folder, "k")
    assert table is not None and table.ids.tolist() == [[1, 2], [3, 4], [5, 6]] and table.offsets.tolist() == [0, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # neither partial is left


def test_a_dpo_reference_is_written_beside_another_writers_partial_without_touching_it(tmp_path):
    """Two runs writing one cached reference at once write partial files of their own: one's partial is never
    the other's to overwrite or rename."""
    from finetune.objectives.reference import read_reference, write_reference

    path = tmp_path / "reference-k.safetensors"
    theirs = tmp_path / "reference-k.safetensors.partial"  # where every run once wrote
    theirs.mkdir()
    write_reference(path, torch.ones(3, 2), "k")
    assert read_reference(path, "k").tolist() == [[1.0, 1.0]] * 3 and theirs.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, theirs.name]


def test_a_teacher_whose_weights_are_not_there_yet_has_no_fingerprint_to_key_a_table(tmp_path):
    """A hub teacher cached with its config but not yet its weights (or a folder without weight files) is not
    identified by its config alone, which a base and all its fine-tunes share: no key until the weights are there
    (the build loads the teacher first, then keys the table)."""
    from finetune.model.loading import base_fingerprint

    teacher = _tiny(0, 32, 3)
    teacher.save_pretrained(tmp_path / "teacher")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tmp_path / "teacher" / "config.json", config_only / "config.json")
    assert base_fingerprint(str(tmp_path / "teacher")) is not None
    assert base_fingerprint(str(config_only)) is None


def test_a_teacher_that_is_the_students_weights_under_another_path_is_refused(tmp_path):
    """The recipe refuses the student's own path as its teacher; a copy of the student's folder is the same
    weights under another name, and teaches nothing just as surely (every divergence 0)."""
    from finetune.objectives import objective_for

    _tiny(0, 32, 3).save_pretrained(tmp_path / "student")
    shutil.copytree(tmp_path / "student", tmp_path / "copy")
    _tiny(1, 32, 3).save_pretrained(tmp_path / "teacher")
    copied = load_recipe(DISTILL_RECIPE, [f"model.name_or_path={tmp_path / 'student'}",
                                          f"distill.teacher={tmp_path / 'copy'}"])  # fmt: skip
    with pytest.raises(FinetuneError, match="holds the same weights as the student .* set distill.teacher"):
        objective_for(copied)
    objective_for(load_recipe(DISTILL_RECIPE, [f"model.name_or_path={tmp_path / 'student'}",
                                               f"distill.teacher={tmp_path / 'teacher'}"]))  # fmt: skip


# ---- What an on-policy step completes, and which steps are on-policy.


def test_an_on_policy_step_completes_each_samples_prompt_before_its_last_reply():
    """Packed rows (samples told apart by positions restarting) and padded ones: each sample's tokens before its
    last run of trained targets; a sample that trains nothing gives none; earlier replies are part of the prompt."""
    ids = [10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 0, 0]
    targets = [IGNORE, 12, 13, IGNORE, IGNORE, 16, 17, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]
    positions = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 0]
    packed = {"input_ids": torch.tensor([ids]), "target_ids": torch.tensor([targets]),
              "position_ids": torch.tensor([positions]), "row_tokens": torch.tensor([12])}  # fmt: skip
    # The first sample: a reply (12, 13) then another (16, 17) trained; its prompt is everything before the last one.
    assert reply_prompts(packed) == [[10, 11, 12, 13, 14, 15]]
    padded = {
        "input_ids": torch.tensor([[5, 6, 7, 8], [5, 9, 0, 0]]),
        "target_ids": torch.tensor([[IGNORE, 7, 8, IGNORE], [9, IGNORE, IGNORE, IGNORE]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }
    assert reply_prompts(padded) == [[5, 6], [5]]


def test_on_policy_steps_are_drawn_from_the_seed_and_step_alone():
    assert not any(on_policy(42, step, 0.0) for step in range(1, 200))
    assert all(on_policy(42, step, 1.0) for step in range(1, 200))
    drawn = [on_policy(42, step, 0.3) for step in range(1, 1001)]
    assert 250 < sum(drawn) < 350 and drawn == [on_policy(42, step, 0.3) for step in range(1, 1001)]
    assert drawn != [on_policy(7, step, 0.3) for step in range(1, 1001)]


# ---- Settings a run cannot honour: one line each, before anything loads.


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distill.on_policy_fraction=1.5"], "distill.on_policy_fraction must be in [0, 1]"),
        (["distill.on_policy_fraction=0.5"], "set distill.max_new_tokens"),
        (["distill.divergence=jsd", "distill.beta=1.0"], "distill.beta must be in (0, 1) for divergence: jsd"),
        (["distill.divergence=reverse_kl", "distill.beta=0.2"], "distill.beta weighs divergence: jsd"),
        (["distill.temperature=0"], "distill.temperature must be > 0"),
        (["distill.max_new_tokens=8"], "distill.max_new_tokens is read by on-policy steps only"),
        (["distill.on_policy_fraction=1", "distill.max_new_tokens=128"], "leaves no room for prompts"),
        (["distill.teacher=outputs/demo/distill/clean/warm/final"], "distill.teacher is the student's own model"),
        (["preference.loss=dpo"], "a distill section trains by its own objective; remove preference"),
        (["distill.teacher_top_k=0"], "distill.teacher_top_k must be >= 1"),
        (
            ["distill.teacher_top_k=8", "distill.on_policy_fraction=0.5", "distill.max_new_tokens=8"],
            "on-policy steps need it to grade the student's own completions, which no table holds",
        ),
        *(
            (["distill.estimator=sampled", "distill.on_policy_fraction=1", "distill.max_new_tokens=8", *more], message)
            for more, message in (
                (["distill.divergence=forward_kl"], "which is divergence: reverse_kl, not forward_kl"),
                (["distill.divergence=jsd"], "which is divergence: reverse_kl, not jsd"),
                (["distill.divergence=reverse_kl", "distill.on_policy_fraction=0.5"], "the data's replies, which it"),
                (["distill.divergence=reverse_kl", "distill.sft_weight=0.1"], "distill.sft_weight adds the cross"),
            )
        ),
    ],
)
def test_distill_settings_a_run_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_recipe(DISTILL_RECIPE, ["distill.on_policy_fraction=0", "distill.max_new_tokens=null", *overrides])


# ---- A real run: the demo's partly trained model teaches the demo's student, half the steps on its own completions,
# on 2 processes, and resumed on 1.


def _distill(tmp_path_factory, assets, teacher, name: str, processes: int, output_dir=None, config=None, **extra):
    output_dir = output_dir or tmp_path_factory.mktemp(name) / "out"
    values = {
        "model.name_or_path": assets / "student", "distill.teacher": teacher,
        "data.train_path": assets / "data" / "train.jsonl", "data.eval_path": assets / "data" / "eval.jsonl",
        "output.dir": output_dir, "output.trackers": "[]", "eval.generate": "null",
        "train.max_steps": 4, "train.eval_every_steps": 4, "train.log_every_steps": 1, "optim.warmup_steps": 0,
        "train.global_batch_size": 8, "train.micro_batch_size": 4, "checkpoint.save_every_steps": 2,
        "distill.divergence": "jsd", "distill.beta": 0.3, "distill.temperature": 1.5, "distill.sft_weight": 0.2,
        "distill.on_policy_fraction": 0.5,  # both kinds of steps in one run
        **extra,
    }  # fmt: skip
    config = config or ("single_gpu.yaml" if processes == 1 else "fsdp2_full_shard.yaml")
    result = launch(config, [f"{k}={v}" for k, v in values.items()], num_processes=processes, recipe=DISTILL_RECIPE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, demo_assets, partly_trained) -> LaunchedRun:
    return _distill(tmp_path_factory, demo_assets, partly_trained, "distill2", 2)


def _per_step(run: LaunchedRun) -> dict[int, dict[str, float]]:
    timed = ("tokens_per_second", "step_seconds", "step", "fill", "generation/tokens_per_second")
    return {m["step"]: {k: v for k, v in m.items() if k not in timed} for m in run.metrics() if "loss" in m}


@pytest.mark.multiprocess
def test_the_demo_report_compares_each_distilled_run_with_sft_from_the_warm_student(
    demo_assets, distill_run, fsdp2_run, capsys
):
    """`finetune demo report-distill` (make demo-distill's report): a line per model with its exact match, the
    distilled run named by how it trained, and the best distillation's gain over SFT from those figures."""
    from finetune.run import demo

    demo.report_distill(str(demo_assets), str(demo_assets / "student"), str(fsdp2_run.output_dir),
                        [str(distill_run.output_dir)], "clean data")  # fmt: skip
    out = capsys.readouterr().out
    distilled = "distilled 50% on-policy, jsd"  # the run's on_policy_fraction and divergence
    scores = dict(re.findall(rf"^(SFT, continued|{distilled})\s+[\d.]+\s+(\d+)/200", out, re.M))
    assert set(scores) == {"SFT, continued", distilled}, out
    gain = (int(scores[distilled]) - int(scores["SFT, continued"])) / 2
    assert f"clean data: the best distillation ({distilled}) {gain:+.1f} points" in out


@pytest.mark.multiprocess
def test_distillation_resumed_on_one_process_samples_and_trains_as_on_two(
    distill_run, tmp_path_factory, demo_assets, partly_trained
):
    """The 2-process run's checkpoint at step 2 resumed on 1 process: its steps 3 (the data's) and 4 (the student's
    own completions, sampled on one process where two sampled them before) log and train what the 2-process run's
    did, to its final weights: 1 process and 2 alike, and the resume exact and elastic."""
    steps = _per_step(distill_run)
    # The seed's draw at a fraction of 0.5: steps 1 and 4 on the student's completions, 2 and 3 on the data.
    assert [steps[s]["on_policy"] for s in (1, 2, 3, 4)] == [1.0, 0.0, 0.0, 1.0]
    assert 0 < steps[1]["completions/mean_length"] <= 16 and "completions/mean_length" not in steps[2]
    assert all(steps[s]["divergence"] > 0 and steps[s]["cross_entropy"] > 0 for s in steps)
    output_dir = tmp_path_factory.mktemp("distill_resumed") / "out"
    shutil.copytree(distill_run.output_dir / "checkpoints" / "step_2", output_dir / "checkpoints" / "step_2")
    resumed = _distill(tmp_path_factory, demo_assets, partly_trained, "", 1, output_dir, "fsdp2_full_shard.yaml",
                       **{"checkpoint.resume": "auto"})  # fmt: skip
    assert sorted(_per_step(resumed)) == [3, 4]
    for step, values in _per_step(resumed).items():
        assert values == pytest.approx(steps[step], rel=1e-4, abs=1e-6), step
    final, wanted = (load_file(run.output_dir / "final" / "model.safetensors") for run in (resumed, distill_run))
    assert max((final[k] - wanted[k]).abs().max().item() for k in final) < 1e-5
    (evaluated,) = [m for m in distill_run.metrics() if "eval_loss" in m]
    (evaluated_one,) = [m for m in resumed.metrics() if "eval_loss" in m]
    assert evaluated == pytest.approx(evaluated_one) and evaluated["eval_divergence"] > 0  # each sample once
    loss = evaluated["eval_divergence"] + 0.2 * evaluated["eval_cross_entropy"]
    assert evaluated["eval_loss"] == pytest.approx(loss)
    assert "teacher: " in distill_run.log and "frozen, sharded as the policy over a 2 mesh (distill.teacher)" in (
        distill_run.log
    )
    # An export is the student's folder: its config, not the teacher's.
    exported = json.loads((distill_run.output_dir / "final" / "config.json").read_text())
    assert exported["hidden_size"] == 64 and exported["num_hidden_layers"] == 2


@pytest.mark.multiprocess
def test_a_teacher_table_computed_on_two_processes_is_read_back_by_a_resume_on_one(
    tmp_path_factory, demo_assets, partly_trained
):
    """distill.teacher_top_k: the table computed before the first step on 2 processes (rows dealt between them),
    then read back, not recomputed, by the run's step-2 checkpoint resumed on 1 process, whose steps 3 and 4 and
    evaluation (train and eval rows both looked up) are the 2-process run's, to its final weights."""
    table = {"distill.teacher_top_k": 16, "distill.on_policy_fraction": 0, "distill.max_new_tokens": "null"}
    two = _distill(tmp_path_factory, demo_assets, partly_trained, "table2", 2, **table)
    output_dir = tmp_path_factory.mktemp("table_resumed") / "out"
    shutil.copytree(two.output_dir / "checkpoints" / "step_2", output_dir / "checkpoints" / "step_2")
    one = _distill(tmp_path_factory, demo_assets, partly_trained, "", 1, output_dir, "fsdp2_full_shard.yaml",
                   **table, **{"checkpoint.resume": "auto"})  # fmt: skip
    assert "teacher: its top 16 tokens at " in two.log and " computed in " in two.log
    assert "teacher: its top 16 tokens at " in one.log and "frozen" not in one.log  # read, no teacher loaded
    steps = _per_step(two)
    assert all(steps[s]["divergence"] > 0 and steps[s]["on_policy"] == 0 for s in steps)
    assert sorted(_per_step(one)) == [3, 4]
    for step, values in _per_step(one).items():
        assert values == pytest.approx(steps[step], rel=1e-4, abs=1e-6), step
    final, wanted = (load_file(run.output_dir / "final" / "model.safetensors") for run in (one, two))
    assert max((final[k] - wanted[k]).abs().max().item() for k in final) < 1e-5
    (evaluated,), (evaluated_one,) = ([m for m in run.metrics() if "eval_loss" in m] for run in (two, one))
    assert evaluated == pytest.approx(evaluated_one) and evaluated["eval_divergence"] > 0


def test_a_run_with_the_sampled_estimator_trains_on_its_samples_and_logs_the_estimate(
    tmp_path_factory, demo_assets, partly_trained
):
    """distill.estimator: sampled in a real run (1 process, FSDP2, the chunked path): every step on-policy, the log's
    divergence the estimate (no cross-entropy: the tokens are the student's own), the evaluation the full reverse
    KL and cross-entropy on the held-out replies, and the student's weights changed."""
    sampled = {"distill.estimator": "sampled", "distill.divergence": "reverse_kl", "distill.beta": 0.5,
               "distill.sft_weight": 0, "distill.on_policy_fraction": 1, "distill.max_new_tokens": 8}  # fmt: skip
    run = _distill(tmp_path_factory, demo_assets, partly_trained, "sampled", 1, None, "fsdp2_full_shard.yaml",
                   **sampled, **{"checkpoint.save_every_steps": 0})  # fmt: skip
    steps = _per_step(run)
    assert sorted(steps) == [1, 2, 3, 4] and all(steps[s]["on_policy"] == 1.0 for s in steps)
    assert all("divergence" in steps[s] and "cross_entropy" not in steps[s] for s in steps)
    assert all(steps[s]["loss"] == pytest.approx(steps[s]["divergence"]) for s in steps)
    (evaluated,) = [m for m in run.metrics() if "eval_loss" in m]
    assert evaluated["eval_divergence"] > 0 and evaluated["eval_cross_entropy"] > 0
    final = load_file(run.output_dir / "final" / "model.safetensors")
    start = load_file(demo_assets / "student" / "model.safetensors")
    assert max((final[k] - start[k]).abs().max().item() for k in final) > 0


def test_the_plan_counts_the_teacher_sharded_or_its_table_and_the_on_policy_rollouts(demo_assets):
    from helpers import CONFIGS

    from finetune.engine.launch import read_launch
    from finetune.plan.estimates import estimate
    from finetune.plan.shape import recipe_shape

    settings = [f"model.name_or_path={demo_assets / 'student'}", f"distill.teacher={demo_assets / 'base'}",
                f"data.train_path={demo_assets / 'data' / 'train.jsonl'}", "data.eval_path=null",
                "eval.generate=null"]  # fmt: skip
    recipe = load_recipe(DISTILL_RECIPE, settings)
    alone = load_recipe(DISTILL_RECIPE, [*settings, "distill=null"])
    launch = read_launch(CONFIGS / "fsdp2_full_shard.yaml", 2, 1)
    shape, student = recipe_shape(recipe), recipe_shape(alone)
    assert (shape.parameters, shape.teacher, student.teacher) == (134_208, 858_752, 0)
    with_teacher, without = (estimate(s, r, launch, "full_shard") for s, r in ((shape, recipe), (student, alone)))
    assert with_teacher.parameters - without.parameters == 858_752 * 2 // 2  # in bf16, the compute, over 2 processes
    head_and_hidden = (shape.vocab + 8 * 128) * 128 * 2  # bf16 compute: the teacher's head copy, its hidden states
    assert with_teacher.activations - without.activations == head_and_hidden
    # A top-k table: the teacher beside the model's parameters while the table is computed, none while training.
    table = load_recipe(DISTILL_RECIPE, [*settings, "distill.on_policy_fraction=0", "distill.max_new_tokens=null",
                                         "distill.teacher_top_k=16"])  # fmt: skip
    tabled = estimate(recipe_shape(table), table, launch, "full_shard")
    assert (tabled.parameters, tabled.activations) == (without.parameters, without.activations)
    assert tabled.device_at_table >= with_teacher.parameters and without.device_at_table == 0
    # On-policy steps (the recipe's): a completion per row of the step (8 x 1 accumulation on each of 2
    # processes), each with a KV cache of data.max_length tokens in every layer, bf16.
    assert with_teacher.generation.kv_cache == 8 * 128 * shape.layers * 2 * shape.kv_hidden * 2
    assert tabled.generation is None and without.generation is None
    # The sampled estimator: the teacher beside the model, but no copy of its head nor its hidden states.
    sampled = load_recipe(DISTILL_RECIPE, [*settings, "distill.on_policy_fraction=1", "distill.estimator=sampled",
                                           "distill.divergence=reverse_kl"])  # fmt: skip
    estimated = estimate(recipe_shape(sampled), sampled, launch, "full_shard")
    assert (estimated.parameters, estimated.activations) == (with_teacher.parameters, without.activations)


def test_finetune_check_refuses_a_teacher_that_is_not_there_naming_the_setting(demo_assets, tmp_path):
    from helpers import CONFIGS

    from finetune.engine.launch import read_launch
    from finetune.plan.verdict import check

    missing = tmp_path / "no_teacher"
    recipe = load_recipe(
        DISTILL_RECIPE, [f"model.name_or_path={demo_assets / 'student'}", f"distill.teacher={missing}"]
    )
    with pytest.raises(FinetuneError, match=f"distill.teacher {missing} is not a folder"):
        check(recipe, read_launch(CONFIGS / "fsdp2_full_shard.yaml", 2, 1), 80 * 2**30)


def test_the_plan_names_the_teachers_settings_when_its_config_is_missing_or_not_offline(demo_assets, tmp_path):
    """`finetune plan` of a distillation whose teacher's architecture it cannot read names the teacher's settings
    (distill.teacher_config_file, distill.teacher), never the student's, which are there."""
    from helpers import CONFIGS

    from finetune.engine.launch import read_launch
    from finetune.plan.verdict import plan

    launch, student = (
        read_launch(CONFIGS / "fsdp2_full_shard.yaml", 2, 1),
        f"model.name_or_path={demo_assets / 'student'}",
    )
    missing = load_recipe(DISTILL_RECIPE, [student, f"distill.teacher_config_file={tmp_path / 'none.json'}"])
    with pytest.raises(FinetuneError, match=r"^distill.teacher_config_file .*none.json does not exist"):
        plan(missing, launch, 80 * 2**30)
    offline = load_recipe(DISTILL_RECIPE, [student, "distill.teacher=someone/not-cached-teacher"])
    with pytest.raises(
        FinetuneError, match=r"\(distill.teacher\) is not available offline.*set distill.teacher_config_"
    ):
        plan(offline, launch, 80 * 2**30)


def test_an_adapter_or_a_checkpoint_as_the_teacher_is_refused_with_the_command_that_makes_a_model_of_it(tmp_path):
    """A LoRA adapter folder or a training checkpoint named as distill.teacher is not a model: the message says
    which, and the export that makes one (not that the architecture is unavailable offline)."""
    from finetune.config import ModelConfig
    from finetune.model.loading import load_model_config

    adapter, checkpoint = tmp_path / "final", tmp_path / "step_8"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    with pytest.raises(FinetuneError, match="distill.teacher .*final is a LoRA adapter.*--merge"):
        load_model_config(ModelConfig(name_or_path=str(adapter)), "distill.teacher")
    with pytest.raises(FinetuneError, match="distill.teacher .*step_8 is a training checkpoint.*finetune export"):
        load_model_config(ModelConfig(name_or_path=str(checkpoint)), "distill.teacher")


def test_a_teacher_with_fewer_positions_than_the_rows_is_refused_before_anything_loads(demo_assets, tmp_path):
    """The student's positions are checked against data.max_length; so are a teacher's (and a preference
    reference's), which grade the same rows: before loading, naming the setting."""
    from finetune.run.build import preflight

    _tiny(0, 32, 3).save_pretrained(tmp_path / "short")  # 64 positions
    recipe = load_recipe(DISTILL_RECIPE, [
        f"model.name_or_path={demo_assets / 'student'}", f"distill.teacher={tmp_path / 'short'}",
        f"data.train_path={demo_assets / 'data' / 'train.jsonl'}",
        f"data.eval_path={demo_assets / 'data' / 'eval.jsonl'}",
        f"output.dir={tmp_path / 'out'}", "data.max_length=128",
    ])  # fmt: skip
    with pytest.raises(
        FinetuneError, match=r"data.max_length=128 exceeds the 64 positions of .*short \(distill.teacher\)"
    ):
        preflight(recipe)


def test_launches_distillation_cannot_run_are_refused_before_anything_loads():
    from finetune.engine.launch import environment_problems

    recipe = load_recipe(DISTILL_RECIPE, ["eval.generate=null"])  # on-policy half the steps
    (problem,) = environment_problems(recipe, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "WORLD_SIZE": "2"})
    assert "on-policy distillation (distill.on_policy_fraction > 0) generates under FSDP2" in problem
    off_policy = load_recipe(DISTILL_RECIPE, ["eval.generate=null", "distill.on_policy_fraction=0",
                                              "distill.max_new_tokens=null"])  # fmt: skip
    assert environment_problems(off_policy, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}) == []
    split = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2",
             "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}  # fmt: skip
    problems = environment_problems(load_recipe(DISTILL_RECIPE, ["model.attn_implementation=varlen"]), split)
    assert any("distillation (distill) runs its teacher on whole rows" in p for p in problems), problems


def test_the_signal_script_splits_each_completion_at_its_first_wrong_token(demo_assets, partly_trained):
    """bench/distill_signal.py (docs/distillation.md, why on-policy steps learned less): the shares of the sampled
    tokens before, at and after each completion's first wrong token add up to every token; a random student's
    completions are wrong from their first token."""
    from helpers import REPO

    test_set = demo_assets / "data" / "test.jsonl"
    command = [sys.executable, str(REPO / "bench" / "distill_signal.py"), "--student", str(demo_assets / "student"),
               "--teacher", str(partly_trained), "--data", str(test_set), "--samples", "8"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    shares = dict(re.findall(r"^(before|first wrong|after)\s+([\d.]+)%", result.stdout, re.M))
    assert "before" not in shares and abs(sum(map(float, shares.values())) - 100) < 0.2, result.stdout
    assert "8 completions at temperature 1.0" in result.stdout
