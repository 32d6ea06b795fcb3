"""A tied-embedding GPT-2 through FSDP2 on 2 processes: wrapped by GPT2Block, exported tied."""

from __future__ import annotations

import pytest
import torch
from conftest import Run, launch, per_sample_eval_loss, recipe_overrides
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory, demo_assets) -> Run:
    base = tmp_path_factory.mktemp("gpt2") / "base"
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    output_dir = base.parent / "out"
    overrides = recipe_overrides(demo_assets, output_dir, **{"model.name_or_path": base})
    result = launch(
        "fsdp2_full_shard.yaml", overrides, launch_args=("--fsdp_transformer_layer_cls_to_wrap", "GPT2Block")
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return Run(result, output_dir)


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


def test_bf16_export_of_a_tied_model_stays_tied(tmp_path, demo_assets):
    from accelerate import Accelerator

    from finetune.export import export_model

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    export_model(Accelerator(cpu=True), model, tokenizer, tmp_path / "final", torch.bfloat16)
    assert not (tmp_path / "final.partial").exists()
    with safe_open(tmp_path / "final" / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()  # noqa: SIM118 (safe_open is no dict)
        assert weights.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype="auto")  # config.json says bf16
    assert reloaded.dtype == torch.bfloat16
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(reloaded.transformer.wte.weight, model.transformer.wte.weight.to(torch.bfloat16))
