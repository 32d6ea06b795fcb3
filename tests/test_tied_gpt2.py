"""A tied-embedding GPT-2 through FSDP2 on 2 processes: wrapped by GPT2Block, exported tied."""

from __future__ import annotations

import pytest
from helpers import per_sample_eval_loss
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.multiprocess


def test_gpt2_blocks_are_the_units_and_loss_goes_down(gpt2_run):
    assert "GPT2Block                    x2" in gpt2_run.log
    losses = gpt2_run.losses()
    assert max(losses[-3:]) < 0.8 * losses[0]


def test_export_keeps_embeddings_tied(gpt2_run, demo_assets):
    final = gpt2_run.output_dir / "final"
    with safe_open(final / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # stored once, as transformers does
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(final)
    measured = [m["eval_loss"] for m in gpt2_run.metrics() if "eval_loss" in m][-1]
    assert per_sample_eval_loss(model, tokenizer, demo_assets / "data" / "eval.jsonl") == pytest.approx(
        measured, rel=1e-4
    )
