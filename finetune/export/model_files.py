"""The files of a model folder other than its weights, as checkpoints' `hf/` folders and every export hold them.

An export is the base's folder with new weights: every file a reader of the base needs is there. Written anew
with `tokenizer.save_pretrained`, they would not be: under transformers 5 it writes `tokenizer.json` and a
`tokenizer_config.json` of its own, so the SentencePiece model (`tokenizer.model`) that Mistral, Mixtral,
Llama-2, Phi-3 and Gemma ship is lost, and llama.cpp's converter, which reads it, refuses the export or builds
a vocabulary that splits words differently from the base's. So the base's files are copied as the base wrote
them, and the run writes only what it changed: `config.json` always (its dtype and architecture are the
run's), the chat template when the recipe trained with another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.model.score_head import is_reward_model
from finetune.storage.checkpoint import ADAPTER_RECORD

# Weights and training state: the run writes weights of its own, and state of another run means nothing here.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")
# Written by the run itself, or describing the base rather than the new weights (its model card and scores).
_NOT_CARRIED = {"config.json", "adapter_config.json", ADAPTER_RECORD, "README.md", "trainer_state.json"}
# The only folder a reader of a model needs: the named chat templates transformers 5 and llama.cpp read.
_CARRIED_FOLDERS = {"additional_chat_templates"}
# The files a tokenizer is read from; a base with none of them (a hub id not in the cache) is saved instead.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_TEMPLATE_FILE = "chat_template.jinja"


def save_model_files(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    adapter_record: dict[str, Any] | None,
    base: Path | None,
    folder: Path,
) -> None:
    """Everything of a Hugging Face model folder but the weights, into `folder`: the files of `base` (the
    model's local folder) as it wrote them, the run's config and, where the run trained with another chat
    template, that template; for an adapter run (`adapter_record`: `weights.Weights.record`) the adapter config
    and record. Without a local base, the tokenizer and generation config are written from memory."""
    folder.mkdir(parents=True, exist_ok=True)
    if base is not None and any((base / name).is_file() for name in _TOKENIZER_FILES):
        copy_base_files(base, folder)
        write_chat_template(folder, tokenizer.chat_template, trained_from=base)
        if is_reward_model(model.config):  # its pad id locates the score for every reader: config and tokenizer agree
            write_pad_token(folder, tokenizer.pad_token)
    else:
        tokenizer.save_pretrained(folder)
    model.config.save_pretrained(folder)
    generation_file = folder / "generation_config.json"
    if not generation_file.exists() and model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    if adapter_record is not None:
        from finetune.model.adapters import write_adapter_files

        write_adapter_files(model, adapter_record, folder)


def carried_files(base: Path) -> list[Path]:
    """The files and folders of `base` that travel into every checkpoint and export: all but weights, the
    config the run writes itself, and what describes the base rather than the new weights."""
    carried = []
    for path in sorted(base.iterdir()):
        if path.is_dir():
            if path.name in _CARRIED_FOLDERS:
                carried.append(path)
        elif path.name.endswith(".index.json") or path.name.endswith(_WEIGHT_SUFFIXES) or path.name.startswith("."):
            continue  # a weights index, weights, or a hub cache's bookkeeping
        elif path.name not in _NOT_CARRIED:
            carried.append(path)
    return carried


def copy_base_files(base: Path, folder: Path) -> None:
    for path in carried_files(base):
        if path.is_dir():
            shutil.copytree(path, folder / path.name, dirs_exist_ok=True)
        else:
            shutil.copyfile(path, folder / path.name)  # not copy2: a hub snapshot's files are links into blobs


def default_template(folder: Path) -> str | None:
    """The chat template readers of `folder` render with: `chat_template.jinja` where it exists (transformers
    reads it first), else tokenizer_config.json's template (a string, or the one named "default")."""
    jinja = folder / _TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        return next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def write_chat_template(folder: Path, template: str | None, trained_from: Path) -> None:
    """Make `template` the one every reader of `folder` renders with, unless it is already the default of
    `trained_from`. Both places are written: transformers reads `chat_template.jinja` first, llama.cpp's
    converter tokenizer_config.json's `chat_template` first."""
    if template is None or template == default_template(trained_from):
        return
    (folder / _TEMPLATE_FILE).write_text(template, encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        settings = json.loads(config.read_text(encoding="utf-8"))
        if "chat_template" in settings:
            settings["chat_template"] = template
            config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_pad_token(folder: Path, pad_token: str) -> None:
    """Make `pad_token` the pad of the tokenizer in `folder` (a reward model padding with another token than its
    base's: `finetune.model.score_head.score_pad_id`)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return
    settings = json.loads(config.read_text(encoding="utf-8"))
    written = settings.get("pad_token")
    if (written.get("content") if isinstance(written, dict) else written) != pad_token:
        settings["pad_token"] = pad_token
        config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
