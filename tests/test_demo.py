"""The demo's own steps: build (idempotent) and the before/after report on a trained run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from finetune.run import demo


def test_build_is_offline_and_idempotent(demo_assets, capsys):
    assert (demo_assets / "base" / "model.safetensors").exists()
    for split, size in (("train", demo.NUM_TRAIN), ("eval", demo.NUM_EVAL), ("test", demo.NUM_TEST)):
        assert len((demo_assets / "data" / f"{split}.jsonl").read_text().splitlines()) == size
    train = set((demo_assets / "data" / "train.jsonl").read_text().splitlines())
    test = (demo_assets / "data" / "test.jsonl").read_text().splitlines()
    prompts = {line.split('"content": "')[1].split('"')[0] for line in train}
    assert not any(line.split('"content": "')[1].split('"')[0] in prompts for line in test)
    demo.build(str(demo_assets))
    assert "reusing" in capsys.readouterr().out


def test_report_compares_base_and_exported_model(demo_assets, fsdp2_run, capsys):
    demo.report(str(demo_assets), str(fsdp2_run.output_dir))
    out = capsys.readouterr().out
    base = re.search(r"base \(random init\)\s+([\d.]+)\s+(\d+)/200", out)
    tuned = re.search(r"fine-tuned \(exported\)\s+([\d.]+)\s+(\d+)/200", out)
    assert base and tuned, out
    assert float(tuned.group(1)) < 0.8 * float(base.group(1))
    assert int(base.group(2)) == 0


def test_the_noisy_data_is_wrong_for_the_lists_below_the_fraction_alone(demo_assets, tmp_path, capsys):
    """Distillation's second case (`finetune demo build --noise`): the lists whose first digit is below 10 x the
    fraction get one wrong reply each (the same every time), every other list its correct one."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(demo_assets / "data" / "train.jsonl", data / "train.jsonl")
    written = demo.write_noisy(data, 0.3)
    clean = [json.loads(line)["messages"] for line in (data / "train.jsonl").read_text().splitlines()]
    noisy = [json.loads(line)["messages"] for line in written.read_text().splitlines()]
    wrong = 0
    for (user, reply), (same_user, noisy_reply) in zip(clean, noisy, strict=True):
        assert same_user == user
        digits = user["content"].split()[1:]
        assert reply["content"] == " ".join(reversed(digits))
        if int(digits[0]) < 3:
            wrong += 1
            assert noisy_reply["content"] != reply["content"]
            assert noisy_reply["content"].split()[:-2] == reply["content"].split()[:-2]
        else:
            assert noisy_reply == reply
    assert 0.25 < wrong / len(clean) < 0.35
    assert f"{wrong:,} of {len(clean):,} replies wrong" in capsys.readouterr().out
    assert demo.write_noisy(data, 0.0).read_text() == (data / "train.jsonl").read_text()
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl", "train_noisy.jsonl"]  # no partial file left


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["build", "--noise", "1.5"], "--noise is the share of training replies made wrong, between 0 and 1; got 1.5"),
        (["report", "--noise", "0.3"], "--noise is read by `finetune demo build` only, not report; remove it"),
        (["build", "--sft", "x"], "--sft is read by `finetune demo report-distill` only, not build; remove it"),
        (["report", "--policy", "x"], "--policy is read by `finetune demo build-rm` only, not report; remove it"),
        (["build-rm", "--policy", "x"], "x holds no model; train the policy first"),
        (
            ["report-distill", "--sft", "x"],
            "finetune demo report-distill compares runs from one warm student: give --before, --distilled",
        ),
    ],
)
def test_demo_options_that_cannot_be_honoured_are_refused_in_one_line(tmp_path, arguments, message):
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "demo", *arguments, "--dir", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"finetune: error: {message}"), line
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_reward_model_pairs_hold_the_policys_own_wrong_replies(demo_assets, partly_trained, tmp_path, capsys):
    """`finetune demo build-rm`: each list's distinct wrong sampled replies (never an empty one) and its hard
    negatives (a near miss, one digit changed at each position, the list unreversed), each once, paired with the
    correct reversal; the same pairs from the same policy and seed, written once."""
    from finetune.run import demo_reward

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "eval"):
        prompts = (demo_assets / "data" / f"prompts_{split}.jsonl").read_text().splitlines()[:12]
        (data / f"prompts_{split}.jsonl").write_text("\n".join(prompts) + "\n")
    demo_reward.build(str(tmp_path), str(partly_trained), samples=4)
    first = (data / "rm_pairs_train.jsonl").read_text()
    pairs = [json.loads(line) for line in first.splitlines()]
    answers = {json.loads(line)["prompt"][0]["content"]: json.loads(line)["answer"]
               for line in (data / "prompts_train.jsonl").read_text().splitlines()}  # fmt: skip
    by_prompt: dict[str, list[str]] = {}
    for pair in pairs:
        prompt = pair["prompt"][0]["content"]
        assert pair["chosen"] == [{"role": "assistant", "content": answers[prompt]}]
        by_prompt.setdefault(prompt, []).append(pair["rejected"][0]["content"])
    assert set(by_prompt) == set(answers)
    for prompt, rejected in by_prompt.items():
        assert all(reply not in ("", answers[prompt]) for reply in rejected)
        assert prompt.removeprefix("reverse: ") in rejected or prompt.split()[1:] == prompt.split()[:0:-1]
        digits = answers[prompt].split()
        changed = [r.split() for r in rejected if len(r.split()) == len(digits)]
        for i in range(len(digits)):  # one digit changed at each position
            assert any([j for j, d in enumerate(r) if d != digits[j]] == [i] for r in changed)
        assert len(set(rejected)) == len(rejected) <= 4 + 1 + len(digits) + 1
    assert len(pairs) > len(answers)  # the partly trained model is wrong on some of them: sampled replies are there
    said = capsys.readouterr().out
    assert re.search(r"rm_pairs_train.jsonl: \d+ pairs \(\d+ of 48 sampled replies wrong", said)
    demo_reward.build(str(tmp_path), str(partly_trained), samples=4)
    assert (data / "rm_pairs_train.jsonl").read_text() == first and "reusing" in capsys.readouterr().out
    (data / "rm_pairs_train.jsonl").unlink()
    demo_reward.build(str(tmp_path), str(partly_trained), samples=4)
    assert (data / "rm_pairs_train.jsonl").read_text() == first  # seeded: the same replies again
    assert sorted(p.name for p in data.iterdir()) == sorted(f"{kind}_{split}.jsonl" for kind in ("prompts", "rm_pairs")
                                                            for split in ("train", "eval"))  # fmt: skip
