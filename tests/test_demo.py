"""The demo's own steps: build (idempotent) and the before/after report on a trained run."""

from __future__ import annotations

import re

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
