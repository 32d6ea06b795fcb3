"""`finetune export --merge` folds every adapter finetune trains exactly as PEFT does: LoRA, DoRA and rsLoRA on
linear, GPT-2 Conv1D (square and not) and embedding layers, with modules trained in full beside them, read from
the base's files as transformers reads them (one file or an index of shards, other safetensors beside them)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from finetune.config import PeftConfig
from finetune.errors import FinetuneError
from finetune.export.merge import MergedWeights, model_weight_files, transposed_layers
from finetune.export.weight_files import SafetensorsWeights
from finetune.model.adapters import add_adapters


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(config)


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False)
    return GPT2LMHeadModel(config)


# (model, targets): Linear and Embedding layers of a Llama; GPT-2's Conv1D layers, square (c_proj of attention:
# 32 x 32) and not (c_attn: 32 x 96, c_fc), and its token embedding.
LAYERS = {
    "llama": (llama, ["q_proj", "v_proj", "down_proj", "embed_tokens"]),
    "gpt2": (gpt2, ["c_attn", "c_proj", "c_fc", "wte"]),
}
KINDS = {
    "lora": {},
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
    "dora_rslora_saved_head": {"use_dora": True, "use_rslora": True, "modules_to_save": ["lm_head"]},
}


@pytest.mark.parametrize("layers", sorted(LAYERS))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("base_layout", ["one_file", "sharded"])
def test_the_merge_computes_what_the_adapted_model_did(layers, kind, base_layout, tmp_path):
    torch.manual_seed(0)
    build, targets = LAYERS[layers]
    base = build().eval()
    folder = tmp_path / "base"
    base.save_pretrained(folder, max_shard_size="20KB" if base_layout == "sharded" else "5GB")
    # Files transformers does not read as the model's: the merge must not either.
    save_file({"model.embed_tokens.weight": torch.ones(3)}, folder / "consolidated.safetensors")
    save_file({"base_model.model.x": torch.ones(3)}, folder / "adapter_model.safetensors")
    assert len(model_weight_files(folder)) == (1 if base_layout == "one_file" else len(list(folder.glob("model-*"))))

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, **KINDS[kind])
    adapted = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # as if trained: every adapter tensor moved away from its initialization
        for param in adapted.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    adapter = get_peft_model_state_dict(adapted, save_embedding_layers=False)  # the trained tensors, as training saves
    assert any("lora_embedding_A" in key for key in adapter)  # the embedding has its own adapter names

    merged = MergedWeights(
        SafetensorsWeights(model_weight_files(folder)), adapter, config.to_dict(), transposed_layers(base)
    )
    state = {name: torch.empty(shape) for name, shape in merged.shapes.items()}
    merged.read_into(state)
    model = build()
    model.load_state_dict(state, strict=False)  # tied names absent; the head is untied here
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        trained = adapted(input_ids=ids).logits
        ours = model.eval()(input_ids=ids).logits
        reference = adapted.merge_and_unload().state_dict()
    assert (ours - trained).abs().max().item() <= 1e-5
    for name, tensor in reference.items():
        if name in state:
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_adapters_that_no_merge_could_reproduce_are_refused_before_training():
    tied = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=True))
    for cfg in (PeftConfig(target_modules=["wte"]), PeftConfig(target_modules=["lm_head"]),
                PeftConfig(modules_to_save=["lm_head"])):  # fmt: skip
        with pytest.raises(FinetuneError, match="whose input and output embeddings are tied"):
            add_adapters(copy.deepcopy(tied), cfg)
    with pytest.raises(FinetuneError, match=r"peft.modules_to_save names lm_haed, which .* its modules are named"):
        add_adapters(llama(), PeftConfig(modules_to_save=["lm_haed"]))


def test_the_merge_needs_the_base_models_own_files(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    save_file({"x": torch.ones(2)}, folder / "consolidated.safetensors")
    with pytest.raises(FinetuneError, match="holds no model.safetensors"):
        model_weight_files(folder)
    llama().save_pretrained(folder, max_shard_size="20KB")
    next(folder.glob("model-00002-*")).unlink()
    with pytest.raises(FinetuneError, match="which its index names; download the model again"):
        model_weight_files(folder)
    shutil.rmtree(folder)


def test_a_qlora_merge_without_bitsandbytes_says_so(monkeypatch, tmp_path):
    """Merging onto the 4-bit base as training saw it needs bitsandbytes; without it the message says so (and
    names --merge-onto original), never that the checkpoint is damaged."""
    import sys

    base = llama()
    base.save_pretrained(tmp_path / "base")
    quantized = {"weights": ["model.layers.0.self_attn.q_proj.weight"], "blocksize": 64, "quant_type": "nf4",
                 "compress_statistics": True, "dtype": "float32"}  # fmt: skip
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(FinetuneError, match="needs bitsandbytes: install it .* or pass --merge-onto original"):
        MergedWeights(SafetensorsWeights(model_weight_files(tmp_path / "base")), {},
                      {"lora_alpha": 8, "r": 4}, set(), quantized)  # fmt: skip
