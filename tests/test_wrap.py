"""Wrap-policy validation against real model classes (no processes needed)."""

from __future__ import annotations

import pytest
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from finetune.engine.wrap import Unit, format_wrap_plan, validate_wrap_policy
from finetune.errors import FinetuneError


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def plugin(version: int = 2, **kwargs) -> FullyShardedDataParallelPlugin:
    extra = {"sync_module_states": False} if version == 1 else {}
    return FullyShardedDataParallelPlugin(fsdp_version=version, **extra, **kwargs)


def test_unknown_wrap_class_lists_the_model_classes(llama):
    bad = plugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])
    with pytest.raises(FinetuneError) as info:
        validate_wrap_policy(bad, llama)
    message = str(info.value)
    assert message.startswith("fsdp_transformer_layer_cls_to_wrap names GPT2Block, which LlamaForCausalLM does not")
    assert "use one of: LlamaDecoderLayer, LlamaModel, Embedding, ModuleList" in message


def test_no_class_named_uses_no_split_modules(llama):
    default = plugin(auto_wrap_policy="transformer_based_wrap")
    validate_wrap_policy(default, llama)
    assert default.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert default.auto_wrap_policy is transformer_auto_wrap_policy


def test_gpt2_block_is_accepted_for_gpt2():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32))
    named = plugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])
    validate_wrap_policy(named, gpt2)  # no error, and the class kept as named: the two blocks are the units
    assert named.transformer_cls_names_to_wrap == ["GPT2Block"]
    inferred = plugin(auto_wrap_policy="transformer_based_wrap")  # none named: the model's _no_split_modules
    validate_wrap_policy(inferred, gpt2)
    assert inferred.transformer_cls_names_to_wrap == ["GPT2Block"]


@pytest.mark.parametrize("version", [1, 2])
def test_size_policy_that_wraps_nothing_is_an_error(llama, version):
    too_big = plugin(version, auto_wrap_policy="size_based_wrap", min_num_params=10**9)
    with pytest.raises(FinetuneError, match=r"fsdp_min_num_params=1000000000 wraps no module of LlamaForCausalLM"):
        validate_wrap_policy(too_big, llama)


def test_fsdp2_size_policy_selecting_a_module_list_is_an_error(llama):
    layer_sized = plugin(2, auto_wrap_policy="size_based_wrap", min_num_params=5000)
    with pytest.raises(FinetuneError, match=r"selects model.layers .* a ModuleList that fully_shard cannot wrap"):
        validate_wrap_policy(layer_sized, llama)
    validate_wrap_policy(plugin(1, auto_wrap_policy="size_based_wrap", min_num_params=5000), llama)


def test_plan_table_groups_units_by_class():
    units = [Unit("LlamaForCausalLM", 0, 0), Unit("LlamaDecoderLayer", 100, 50), Unit("LlamaDecoderLayer", 100, 50)]
    assert format_wrap_plan(units).splitlines() == [
        "FSDP wrap plan: 3 units, 200 parameters",
        "  LlamaForCausalLM             x1    0 params each",
        "  LlamaDecoderLayer            x2    100 params each",
    ]
