"""Load the model and tokenizer a recipe names."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune.config import ModelConfig
from finetune.errors import FinetuneError, first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(name_or_path: str) -> None:
    """A path meant as a local folder must exist; otherwise transformers reports it as a bad hub id."""
    looks_local = name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise FinetuneError(
            f"model.name_or_path {name_or_path} is not a folder; point it at a saved model (config.json, "
            "safetensors, tokenizer files) or a hub id such as meta-llama/Llama-3.2-1B"
        )


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (the EOS token when the tokenizer has none)."""
    check_model_path(cfg.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"cannot load a tokenizer from {cfg.name_or_path!r} ({first_line(exc)}); set model.name_or_path "
            "to a hub id or a local folder holding the tokenizer files"
        ) from None
    if not tokenizer.is_fast:
        raise FinetuneError(f"the tokenizer of {cfg.name_or_path!r} is not a fast tokenizer; install `tokenizers`")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg: ModelConfig, activation_checkpointing: bool) -> PreTrainedModel:
    """The model in the recipe's parameter dtype, never in the checkpoint's dtype by accident."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"cannot load a causal LM from {cfg.name_or_path!r} ({first_line(exc)}); set model.name_or_path "
            "to a hub id or a local folder with config.json and safetensors weights"
        ) from None
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # from_pretrained returns the model in eval mode, where dropout and activation checkpointing are off.
    model.train()
    return model


def save_model_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Everything of a Hugging Face model folder but the weights: config, generation config, tokenizer."""
    model.config.save_pretrained(folder)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
