"""Conversations -> token ids with the assistant turns marked for training.

Every conversation is checked and normalized first (content parts become text, null keys are
dropped), so a malformed sample is refused with its index instead of being trained as a repr.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from finetune.errors import FinetuneError, first_line


def encode_chats(
    conversations: list[list[dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    completion_only: bool,
    indices: list[int] | None = None,
) -> list[tuple[list[int], list[bool]]]:
    """Render each conversation with the chat template; mark the assistant turns (with their end-of-turn) as trained.

    Assistant spans are found in characters, by rendering each conversation prefix, and mapped to
    tokens through the fast tokenizer's offsets, so merges across turn boundaries cannot shift them.
    The texts are tokenized in one call: the fast tokenizer is entered once per batch, not per sample.
    `indices` are the samples' positions in the dataset, for error messages.
    """
    indices = indices if indices is not None else list(range(len(conversations)))
    conversations = [chat_messages(messages, index) for messages, index in zip(conversations, indices, strict=True)]
    texts = [_render(tokenizer, messages, index) for messages, index in zip(conversations, indices, strict=True)]
    encodings = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=completion_only)
    if not completion_only:
        return [(ids, [True] * len(ids)) for ids in encodings["input_ids"]]
    encoded = []
    for messages, text, ids, offsets, index in zip(
        conversations, texts, encodings["input_ids"], encodings["offset_mapping"], indices, strict=True
    ):
        spans = _assistant_spans(messages, text, tokenizer, index)
        encoded.append((ids, [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]))
    return encoded


def chat_messages(messages: Any, index: int) -> list[dict[str, Any]]:
    """One conversation as chat templates take it, or a data error naming the sample.

    Content given as a list of parts (`[{"type": "text", "text": ...}]`) becomes its text, as
    multimodal-style templates render it; a part that is not text cannot be trained on here. Keys
    whose value is null are dropped: Arrow gives every message the keys any message has, and a
    template testing `message.tool_calls is defined` must not see a null one.
    """
    where = f"sample {index}"
    if not isinstance(messages, list) or not messages:
        raise FinetuneError(
            f"{where}: messages must be a non-empty list of {{role, content}} objects, got {describe(messages)}; "
            "fix or remove it"
        )
    normalized = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise FinetuneError(
                f"{where}, message {number}: expected an object with a text role, got {describe(message)}; "
                "fix or remove the sample"
            )
        message = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = _text_of_parts(content, f"{where}, message {number}")
        elif content is None and not message.get("tool_calls"):
            raise FinetuneError(
                f"{where}, message {number} ({message['role']}) has no content; give it text or remove the sample"
            )
        elif content is not None and not isinstance(content, str):
            raise FinetuneError(f"{where}, message {number}: content must be text, got {describe(content)}")
        normalized.append(message)
    return normalized


def _text_of_parts(parts: list[Any], where: str) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise FinetuneError(
                f"{where}: content part {describe(part)} is not text; finetune trains on text parts "
                '({"type": "text", "text": ...}) only: remove the others'
            )
        texts.append(part["text"])
    return "".join(texts)


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], index: int, add_generation_prompt: bool = False
) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # templates raise jinja2 errors, or their own via raise_exception
        raise FinetuneError(
            f"sample {index}: the tokenizer's chat template refuses it ({first_line(exc)}); fix or remove the sample"
        ) from None


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _assistant_spans(
    messages: list[dict[str, Any]], text: str, tokenizer: PreTrainedTokenizerBase, index: int
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, the rendered conversation."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], index, add_generation_prompt=True) if i else ""
        # Through the last message is the whole conversation: one render fewer per sample.
        through = text if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], index)
        if not (text.startswith(before) and text.startswith(through)):
            raise FinetuneError(
                "this tokenizer's chat template renders a conversation differently from its prefixes, so assistant "
                "tokens cannot be located; set data.completion_only_loss=false"
            )
        spans.append((len(before), len(through)))
    return spans
