"""model.kernels: liger (finetune/model/kernels.py). Its Triton kernels run on CUDA only: here, that a run which cannot
use them is refused in one line before anything loads; on a GPU (`make test-gpu`), that a model patched with them
trains as the eager one does, to bf16's rounding, under the same parameter names."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import transformers
from helpers import REPO, tiny_config

from finetune.errors import FinetuneError
from finetune.model.kernels import check_kernels, fuse

LIGER = importlib.util.find_spec("liger_kernel") is not None


def test_unset_kernels_ask_nothing():
    check_kernels(None, tiny_config("llama"), "tiny")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_liger_kernels_are_refused_without_a_cuda_device_naming_the_alternative():
    with pytest.raises(FinetuneError, match="no CUDA device; unset model.kernels.*regional compilation"):
        check_kernels("liger", tiny_config("llama"), "tiny")


def test_liger_kernels_are_refused_for_a_mixture_of_experts_and_where_liger_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks after the device's
    with pytest.raises(FinetuneError, match="'tiny-moe' is a mixture of experts.*unset model.kernels"):
        check_kernels("liger", tiny_config("qwen3_moe"), "tiny-moe")
    if not LIGER:
        with pytest.raises(FinetuneError, match=r"needs liger-kernel .*pip install 'finetune\[gpu\]'"):
            check_kernels("liger", tiny_config("llama"), "tiny")
    else:
        with pytest.raises(FinetuneError, match="no kernels for 'tiny-gpt2' \\(model type gpt2\\)"):
            check_kernels("liger", tiny_config("gpt2"), "tiny-gpt2")


def test_the_config_takes_liger_and_nothing_else():
    from finetune.config import ConfigError, load_recipe

    assert load_recipe(REPO / "recipes/demo/tiny_llama.yaml", ["model.kernels=liger"]).model.kernels == "liger"
    with pytest.raises(ConfigError, match="model.kernels"):
        load_recipe(REPO / "recipes/demo/tiny_llama.yaml", ["model.kernels=fused"])


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_liger_kernels_train_as_the_eager_model_under_the_same_names(model_type):
    """The tiny model in bf16 autocast on the GPU, eager and with liger's kernels: the same parameter names, and
    loss and every gradient equal to within what bf16 rounding in another order leaves."""
    config = tiny_config(model_type, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config).cuda()
    fused = copy.deepcopy(eager)
    tokens = torch.randint(0, config.vocab_size, (2, 512), device="cuda")

    def loss_and_grads(model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=tokens).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    expected_loss, expected = loss_and_grads(eager)  # before the patch: liger's rotary replaces a module function
    assert fuse(fused, "liger") is not None
    assert "Liger" in type(fused.model.layers[0].mlp).__name__ or "Liger" in fused.model.layers[0].mlp._get_name()
    loss, grads = loss_and_grads(fused)
    assert grads.keys() == expected.keys()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-2, atol=1e-2)
    for name, grad in grads.items():
        distance = ((grad - expected[name]).norm() / expected[name].norm().clamp_min(1e-12)).item()
        assert distance < 0.03, f"{name}: relative distance {distance:.4f}"
