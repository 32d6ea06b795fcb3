"""Character spans to token ranges: conversations encoded with their trained tokens marked (`encode_chats`), through
the fast tokenizer's encodings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from finetune.data.chat.replies import MultiTurn, RenderedChats, render_chats


@dataclass(slots=True)
class EncodedSamples:
    """A batch's samples as token ids and the tokens trained, in columns (chats here; prompt/completion and
    text alike)."""

    ids: list[list[int]]
    ranges: list[list[tuple[int, int]]]
    """Each sample's trained tokens, as sorted [first, last) ranges: the targets are built from them by slicing."""
    expanded: list[bool]
    reasoning_tokens: list[int]
    """Tokens of reasoning in each sample's replies, trained or not (`train_on_reasoning`)."""


def encode_chats(
    conversations: list[list[dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    completion_only: bool,
    indices: list[int] | None = None,
    multi_turn: MultiTurn = "full",
    tools: list[Any] | None = None,
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each rendered conversation, with its assistant replies (and their end-of-turn) marked trained."""
    encoded = encode_rendered(
        render_chats(conversations, tokenizer, completion_only, indices, multi_turn, tools), tokenizer
    )
    return [(ids, _trained(len(ids), ranges)) for ids, ranges in zip(encoded.ids, encoded.ranges, strict=True)]


def _trained(length: int, ranges: list[tuple[int, int]]) -> list[bool]:
    trained = [False] * length
    for first, last in ranges:
        trained[first:last] = [True] * (last - first)
    return trained


def encode_rendered(
    rendered: RenderedChats, tokenizer: PreTrainedTokenizerBase, train_on_reasoning: bool = True
) -> EncodedSamples:
    """Tokenize the rendered texts in one call (the fast tokenizer is entered once per batch) and map the
    trained character spans to tokens through the encodings, so merges across turn boundaries cannot shift them."""
    ids, ranges, reasoning_tokens = [], [], []
    texts = rendered.texts
    for encoding, text, spans, reasoning in zip(
        encodings(tokenizer, texts), texts, rendered.spans, rendered.reasoning, strict=True
    ):
        sample_ids = encoding.ids
        trained = token_ranges(encoding, spans, len(sample_ids), len(text), covering=True)
        thought = 0
        if reasoning:
            within = token_ranges(encoding, reasoning, len(sample_ids), len(text))
            thought = sum(last - first for first, last in within)
            trained = trained if train_on_reasoning else _without(trained, within)
        ids.append(sample_ids)
        ranges.append(trained)
        reasoning_tokens.append(thought)
    return EncodedSamples(ids, ranges, rendered.expanded, reasoning_tokens)


def encodings(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[Any]:
    """The fast tokenizer's encodings of `texts`, without the special tokens it adds around a text.

    Asked of its `tokenizers` backend directly where the tokenizer's own call would change nothing on it
    (no truncation or padding set, special tokens kept whole): that call also builds a dict of lists
    per text that nothing here reads, a tenth of the time of tokenizing short chats."""
    backend = tokenizer.backend_tokenizer
    if (
        backend.truncation is None
        and backend.padding is None
        and not backend.encode_special_tokens
        and not getattr(tokenizer, "split_special_tokens", False)
    ):
        return backend.encode_batch(texts, add_special_tokens=False)
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False).encodings


def _without(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint ranges less the sorted disjoint `holes`."""
    kept = []
    for first, last in ranges:
        for hole_first, hole_last in holes:
            if hole_first < last and hole_last > first:
                if hole_first > first:
                    kept.append((first, hole_first))
                first = max(first, hole_last)
        if first < last:
            kept.append((first, last))
    return kept


def token_ranges(
    encoding: Any, spans: list[tuple[int, int]], tokens: int, characters: int, covering: bool = False
) -> list[tuple[int, int]]:
    """Each span [lo, hi) of characters of an encoded text (`tokens` long, of `characters`) as the range
    [first, last) of the tokens that start in it, or with `covering` also the token that starts before lo
    and ends inside the span: a reply's first token often begins with the template's space before it
    ("[/TOOL_RESULTS] Paris" tokenized "▁Paris"), and it is the reply's to predict. The fast tokenizer's
    encoding is asked about the few characters that bound the spans: converting every token's offsets to
    Python costs a third of the tokenization of long texts."""
    first_of = _covering_token if covering else _first_token
    ranges = []
    for lo, hi in spans:  # a loop: a comprehension is a call of its own before Python 3.12, per sample
        ranges.append((first_of(encoding, lo, tokens, characters), _first_token(encoding, hi, tokens, characters)))
    return ranges


def _covering_token(encoding: Any, char: int, tokens: int, characters: int) -> int:
    """The first token that ends after `char`: the one holding it (the first of several byte pieces of one
    character), or the first after it where no token holds it."""
    token = encoding.char_to_token(char) if char < characters else None
    if token is None:
        return _first_token(encoding, char, tokens, characters)
    while token > 0 and (encoding.token_to_chars(token - 1) or (0, 0))[1] > char:
        token -= 1
    return token


def _first_token(encoding: Any, char: int, tokens: int, characters: int) -> int:
    """The first token that starts at or after `char` (`tokens` if none does)."""
    token = encoding.char_to_token(char) if char < characters else None
    position = char + 1
    while token is None and position < characters:  # characters no token covers lead to the next
        token = encoding.char_to_token(position)
        position += 1
    token = tokens if token is None else token
    # A token can start before `char` (a merge across it), and several can share a character (byte pieces).
    while token > 0 and (encoding.token_to_chars(token - 1) or (0,))[0] >= char:
        token -= 1
    while token < tokens and (encoding.token_to_chars(token) or (0,))[0] < char:
        token += 1
    return token
