"""Whether two model settings name one model: the check that keeps a run from learning from itself (a
distillation teacher that is a copy of its student teaches nothing, every divergence 0)."""

from __future__ import annotations

from finetune.model.loading import base_fingerprint, model_folder


def same_weights(first: str, second: str) -> bool:
    """Whether two models are one under two names (a copy of a folder): their tokenizers' vocabularies alike, and
    their weight files' names and sizes, and only where those agree every byte (`base_fingerprint`, cached)."""
    from finetune.storage.fingerprint import weight_files

    if None in (folders := (model_folder(first), model_folder(second))):
        return False
    vocabularies = [(folder / "tokenizer.json").read_bytes() if (folder / "tokenizer.json").is_file() else None
                    for folder in folders]  # fmt: skip
    files = [[(file.name, file.stat().st_size) for file in weight_files(folder)] for folder in folders]
    if not files[0] or files[0] != files[1] or vocabularies[0] != vocabularies[1]:
        return False
    return base_fingerprint(first) == base_fingerprint(second)
