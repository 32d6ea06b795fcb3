"""Checkpoints and exports carry the base's own files: a SentencePiece base (Mistral, Llama-2, Phi-3, Gemma
ship `tokenizer.model`) is read back by llama.cpp's own vocabulary reader (gguf-py) as the base is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import launch, recipe_overrides

from finetune.config import ModelConfig
from finetune.export.model_files import default_template, save_model_files
from finetune.model.loading import load_tokenizer, meta_model

# A Mistral-v0.1-style template, kept in tokenizer_config.json as those bases keep it.
_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_SHIPPED = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "LICENSE")


@pytest.fixture(scope="module")
def spm_base(tmp_path_factory, demo_assets) -> Path:
    """A tiny Llama whose tokenizer is a SentencePiece model trained here on the demo's text, its embedding
    padded past the tokenizer (as Mistral-style bases are), folder laid out as such bases ship it."""
    import sentencepiece
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = tmp_path_factory.mktemp("spm") / "base"
    base.mkdir()
    rows = [json.loads(line) for line in (demo_assets / "data" / "train.jsonl").read_text().splitlines()]
    corpus = base.parent / "corpus.txt"
    corpus.write_text("\n".join(m["content"] for row in rows for m in row["messages"]) + "\n[INST] [/INST]\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(base / "tokenizer"), vocab_size=300, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    (base / "tokenizer.vocab").unlink()
    settings = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (base / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": _TEMPLATE}, indent=1))
    special = {k: v for k, v in settings.items() if k != "tokenizer_class"}
    (base / "special_tokens_map.json").write_text(json.dumps(special))
    (base / "LICENSE").write_text("a license that must travel with the weights\n")
    AutoTokenizer.from_pretrained(base).backend_tokenizer.save(str(base / "tokenizer.json"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(base)
    return base


@pytest.fixture(scope="module")
def spm_run(tmp_path_factory, demo_assets, spm_base) -> Path:
    """LoRA on the SentencePiece base, exported as the adapter and merged: every writer of model files."""
    output_dir = tmp_path_factory.mktemp("spm_run") / "out"
    settings = {
        "model.name_or_path": spm_base, "train.max_steps": 2, "train.eval_every_steps": 0, "data.eval_path": "null",
        "peft.r": 4, "output.export_merged": "true", "checkpoint.save_every_steps": 2,
    }  # fmt: skip
    result = launch("fsdp2_full_shard.yaml", recipe_overrides(demo_assets, output_dir, **settings), num_processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    return output_dir


@pytest.mark.multiprocess
@pytest.mark.parametrize("folder", ["checkpoints/step_2/hf", "final", "final_merged"])
def test_checkpoints_and_exports_carry_the_bases_files_as_it_wrote_them(spm_base, spm_run, folder):
    written = spm_run / folder
    for name in _SHIPPED:
        assert (written / name).read_bytes() == (spm_base / name).read_bytes(), name
    if folder != "final":  # the adapter: a PEFT folder, which holds no model's files but the tokenizer's
        assert (written / "generation_config.json").read_bytes() == (spm_base / "generation_config.json").read_bytes()


@pytest.mark.multiprocess
@pytest.mark.parametrize("folder", ["final", "final_merged"])
def test_llama_cpps_reader_reads_the_exports_vocabulary_and_template_as_the_bases(spm_base, spm_run, folder):
    from gguf.vocab import SentencePieceVocab, SpecialVocab

    base, export = SentencePieceVocab(spm_base), SentencePieceVocab(spm_run / folder)
    assert list(export.all_tokens()) == list(base.all_tokens())
    special = SpecialVocab(spm_run / folder, load_merges=False)
    assert special.chat_template == _TEMPLATE
    assert special.special_token_ids == SpecialVocab(spm_base, load_merges=False).special_token_ids


def test_a_template_the_recipe_changed_is_what_every_reader_renders_with(spm_base, tmp_path):
    """The base's files stay as written, but for the template: transformers reads chat_template.jinja first,
    llama.cpp's converter tokenizer_config.json's `chat_template`; both give the trained one."""
    from gguf.vocab import SpecialVocab
    from transformers import AutoConfig, AutoTokenizer

    trained = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(spm_base)), chat_template=trained)
    save_model_files(meta_model(AutoConfig.from_pretrained(spm_base)), tokenizer, None, spm_base, tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == trained
    assert SpecialVocab(tmp_path, load_merges=False).chat_template == trained
    assert default_template(tmp_path) == trained
    assert (tmp_path / "tokenizer.model").read_bytes() == (spm_base / "tokenizer.model").read_bytes()
    untouched = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert untouched.pop("chat_template") == trained
    assert untouched == {k: v for k, v in json.loads((spm_base / "tokenizer_config.json").read_text()).items()
                         if k != "chat_template"}  # fmt: skip


def test_the_bases_template_unchanged_leaves_its_files_byte_for_byte(spm_base, tmp_path):
    from transformers import AutoConfig

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(spm_base)))
    save_model_files(meta_model(AutoConfig.from_pretrained(spm_base)), tokenizer, None, spm_base, tmp_path)
    assert not (tmp_path / "chat_template.jinja").exists()
    for name in _SHIPPED:
        assert (tmp_path / name).read_bytes() == (spm_base / name).read_bytes(), name
    assert not list(tmp_path.glob("*.safetensors"))


def test_config_overrides_reach_the_model_and_the_files_written_with_it(demo_assets, tmp_path):
    """model.config_overrides (a longer context by RoPE scaling): the loaded model computes with them and its
    config.json, as checkpoints and exports write it, carries them; a name the config lacks is refused."""
    from finetune.errors import FinetuneError
    from finetune.model.loading import load_model

    scaled = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    base = load_model(ModelConfig(name_or_path=str(demo_assets / "base")), "none")
    model = load_model(
        ModelConfig(
            name_or_path=str(demo_assets / "base"),
            config_overrides={"max_position_embeddings": 512, "rope_parameters": scaled},
        ),
        "none",
    )
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, base.model.rotary_emb.inv_freq / 4)
    model.config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["max_position_embeddings"] == 512 and written["rope_parameters"] == scaled
    with pytest.raises(FinetuneError, match="rope_parmeters \\(did you mean rope_parameters\\?\\)"):
        load_model(
            ModelConfig(name_or_path=str(demo_assets / "base"), config_overrides={"rope_parmeters": {}}), "none"
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarnn", "factor": 4.0}}, "rope_type 'yarnn' is not a RoPE type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
         "make a config transformers refuses .*original_max_position_embeddings"),
        ({"num_attention_heads": 2}, r"\(num_attention_heads\) change the shapes of the model's weights \(model."),
        ({"num_hidden_layers": 1}, "change the shapes of the model's weights"),
    ],
)  # fmt: skip
def test_config_overrides_transformers_would_fail_on_or_that_reshape_weights_are_refused_before_loading(
    demo_assets, overrides, message
):
    """A typo in a RoPE override was a KeyError in the middle of loading; an override of a shape field loaded the
    checkpoint with those weights initialized at random, in a report few read."""
    from finetune.errors import FinetuneError
    from finetune.model.loading import load_model_config

    with pytest.raises(FinetuneError, match=message):
        load_model_config(ModelConfig(name_or_path=str(demo_assets / "base"), config_overrides=overrides))
