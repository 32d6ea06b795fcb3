"""A reward model's scalar head: the causal LM's last hidden state through `score` (hidden -> 1), as transformers'
`*ForSequenceClassification` classes hold it, so that the exported folder is one every reader loads as it is.

Where the score is read is defined once: at the last token of the scored sequence, the end of the reply as the
template ends it (its end-of-turn marker; EOS for text). transformers' classifiers read it at the rightmost token
that is not `config.pad_token_id`, so a reward model's pad id must never be that last token: a base whose pad is its
EOS (the default finetune gives a tokenizer without one) pads a reward model with another special token instead
(`score_pad_id`), written into the export's config and tokenizer alike.

The head starts at zero: every score is 0 at step 1, so each pair's loss is ln 2 (log(1 + e^margin) with a
margin), the untrained head adds no noise to the first updates, and the backbone's gradient starts as the head
learns. A base that already is a reward model keeps its head.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, PretrainedConfig, PreTrainedTokenizerBase

from finetune.errors import FinetuneError

SCORE = "score"
"""The head's name in the transformers sequence classifiers finetune trains (GenericForSequenceClassification's)."""
REGRESSION = {"num_labels": 1, "problem_type": "regression"}
"""A scalar score, read raw: with problem_type regression no reader (the text-classification pipeline, vLLM's
classify) applies a sigmoid to it."""


def is_reward_model(config: PretrainedConfig) -> bool:
    """Whether `config` describes a scalar sequence classifier (a reward model's folder)."""
    architectures = getattr(config, "architectures", None) or []
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    return classifier and getattr(config, "num_labels", None) == 1


def score_pad_id(tokenizer: PreTrainedTokenizerBase, name: str) -> int:
    """The id a reward model pads with: the tokenizer's pad, unless it is the EOS (a scored sequence may end with it,
    and the score would be read a token early); then the BOS or the unknown token, which no reply ends with."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is not None and pad != eos:
        return pad
    for candidate in (tokenizer.bos_token_id, tokenizer.unk_token_id):
        if candidate is not None and candidate != eos:
            return candidate
    raise FinetuneError(
        f"the tokenizer of {name!r} pads with its EOS token and has no BOS or unknown token to pad with instead; a "
        "reward model's score is read at the last token that is not padding, which would then move: add a pad token "
        "to the base's tokenizer (tokenizer.add_special_tokens, saved with the base)"
    )


@contextlib.contextmanager
def expected_head_swap(config: PretrainedConfig) -> Iterator[None]:
    """While inside, loading a causal LM's weights into its sequence classifier does not report the new `score`
    and the unused `lm_head` (expected: a reward model is made from a causal LM), through the class attributes
    transformers reads for keys to ignore; outside, the class as it was."""
    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(config), None)
    if cls is None:
        yield
        return
    saved = {key: cls.__dict__.get(key) for key in ("_keys_to_ignore_on_load_missing",
                                                    "_keys_to_ignore_on_load_unexpected")}  # fmt: skip
    cls._keys_to_ignore_on_load_missing = [*(cls._keys_to_ignore_on_load_missing or []), rf"^{SCORE}\."]
    cls._keys_to_ignore_on_load_unexpected = [*(cls._keys_to_ignore_on_load_unexpected or []), r"^lm_head\."]
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                delattr(cls, key)
            else:
                setattr(cls, key, value)


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's `score` module, through DDP, compile and PEFT wrappers (PEFT's is the trained copy's wrapper)."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    head = getattr(base, SCORE, None)
    if head is None:
        raise RuntimeError(f"{type(base).__name__} has no {SCORE} head: a reward model is a sequence classifier")
    return head


def zero_score(model: torch.nn.Module) -> None:
    """Start the head at zero (every score 0 at step 1: each pair's loss ln 2)."""
    with torch.no_grad():
        for parameter in score_head(model).parameters():
            parameter.zero_()


def task_type(config: PretrainedConfig) -> str:
    """PEFT's task type for adapters on this model: SEQ_CLS for a reward model (PEFT then trains and saves the
    `score` head in full beside the adapters, and loads the folder as a sequence classifier), else CAUSAL_LM."""
    return "SEQ_CLS" if is_reward_model(config) else "CAUSAL_LM"


def as_reward_model(config: PretrainedConfig) -> PretrainedConfig:
    """`config` as its reward model's (a copy): the family's sequence classifier with one output, which
    `finetune.model.loading.meta_model` builds (a plan counts its score head, not the causal LM's output layer)."""
    config = copy.deepcopy(config)
    config.update(REGRESSION)
    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(config), None)
    if cls is not None:
        config.architectures = [cls.__name__]
    return config
