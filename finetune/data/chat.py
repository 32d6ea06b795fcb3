"""Conversations -> token ids with the assistant replies marked for training.

Every conversation is checked and normalized first (content parts become text, null keys are
dropped, tools parsed), so a malformed sample is refused with its index instead of being trained
as a repr. The batch is then rendered by the chat template in one call, and each conversation's
replies are located in its text: from a *skeleton* (the template's text for the conversation's
structure, rendered once per batch with placeholders for the texts) where filling it with the texts
gives the rendering exactly, else by rendering the conversation again with placeholders for its
replies (`render_chats`), which works for templates that rewrite the conversation. Character spans
become token ranges through the fast tokenizer's encodings (`encode_rendered`).

Everything per sample here runs for every conversation of a dataset, so the common case (roles
and texts, no tools, a template that copies texts) is kept to a few list operations per sample.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from transformers import PreTrainedTokenizerBase

from finetune.errors import FinetuneError, first_line

MultiTurn = Literal["full", "per_turn", "last"]


# A batch is kept as columns (one list a field, over its samples): an object is made per sample only
# where a conversation needs more than the common path. Those per-sample records are plain (not frozen)
# dataclasses: a frozen one's __init__ costs three times as much.


@dataclass(slots=True)
class RenderedChat:
    """One training sample of a conversation: its rendered text and the character spans trained."""

    text: str
    spans: list[tuple[int, int]]
    expanded: bool = False
    """One of the per-turn samples of a conversation whose replies could not be located together."""
    reasoning: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """The character spans of reasoning (think blocks' text) inside the replies."""


@dataclass(slots=True)
class RenderedChats:
    """A batch's training samples of conversations, as columns of `RenderedChat`'s fields; sample n is `[n]`."""

    texts: list[str]
    spans: list[list[tuple[int, int]]]
    reasoning: list[list[tuple[int, int]]]
    expanded: list[bool]

    @classmethod
    def of(cls, samples: list[RenderedChat]) -> RenderedChats:
        return cls([s.text for s in samples], [s.spans for s in samples], [s.reasoning for s in samples],
                   [s.expanded for s in samples])  # fmt: skip

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, n: int) -> RenderedChat:
        return RenderedChat(self.texts[n], self.spans[n], self.expanded[n], self.reasoning[n])


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


def render_chats(
    conversations: list[list[dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    completion_only: bool,
    indices: list[int] | None = None,
    multi_turn: MultiTurn = "full",
    tools: list[Any] | None = None,
) -> RenderedChats:
    """Render each conversation (with its `tools`, JSON schemas given to the template) with the chat
    template and locate its assistant replies in the text.

    Replies are located without assuming that a conversation's prefixes render like its start (many
    templates add dates, move or drop the system message, strip earlier reasoning, or end the text
    differently): the conversation is rendered again with a unique placeholder in place of each reply,
    the template text between placeholders is found in the real rendering, and what lies between is
    the reply as the template rendered it. A reply's span starts after the assistant header (what the
    template writes for a generation prompt) and runs through the turn's end marker, so what the
    template generates around the content (a think block, tool calls) is trained with it.
    `multi_turn`: "full" trains every reply of a conversation in one sample, "last" only its last
    reply, "per_turn" makes one sample per reply (each prompt as rendered for generation) of the
    conversations whose replies cannot be located together. `indices` name samples in errors.
    """
    indices = indices if indices is not None else list(range(len(conversations)))
    batch = _check(conversations, tools if tools is not None else [None] * len(conversations), indices, tokenizer)
    texts = _render_all(batch)
    if not completion_only:
        if any(batch.untrained):
            n = next(n for n, skipped in enumerate(batch.untrained) if skipped)
            raise FinetuneError(
                f"sample {indices[n]} marks replies with weight 0 (not trained), but data.completion_only_loss=false "
                "trains every token; set data.completion_only_loss=true or remove the weights"
            )
        return RenderedChats(texts, [[(0, len(text))] for text in texts], [[] for _ in texts], [False] * len(texts))
    shape = template_shape(tokenizer)
    spans, reasoning, per_turn = [], [], {}
    for n, (text, (skeleton, values)) in enumerate(zip(texts, _skeletons(batch, shape), strict=True)):
        replies = skeleton.replies if skeleton is not None else _replies(batch.messages[n])
        if not replies:
            raise FinetuneError(
                f"sample {indices[n]} has no assistant message to train on; remove it, or set "
                "data.completion_only_loss=false to train on all of its text"
            )
        trained = replies[-1:] if multi_turn == "last" else replies
        if batch.untrained[n]:  # replies of weight 0: context only (a sample left with none trains nothing)
            trained = tuple(i for i in trained if i not in batch.untrained[n])
            replies = tuple(i for i in replies if i not in batch.untrained[n])
            if not trained:
                spans.append([])
                reasoning.append([])
                continue
        try:
            located = _filled_spans(skeleton, values, trained, text) if skeleton is not None else None
            located = located or _reply_spans(batch.chat(n), shape, trained, text)
        except _UnclosedThink:
            raise unclosed_think(indices[n]) from None
        if located is None:
            if multi_turn != "per_turn":
                raise FinetuneError(
                    f"sample {indices[n]}: the chat template renders this conversation so that its assistant "
                    "replies cannot be located in it; set data.multi_turn=per_turn (one sample per reply, each "
                    "prompt as rendered for generation) or data.multi_turn=last (its last reply only)"
                )
            try:
                per_turn[n] = _per_turn(batch.chat(n), shape, list(trained))
            except _UnclosedThink:
                raise unclosed_think(indices[n]) from None
            located = [], []
        spans.append(located[0])
        reasoning.append(located[1])
    rendered = RenderedChats(texts, spans, reasoning, [False] * len(texts))
    return _expanded(rendered, per_turn) if per_turn else rendered


def _expanded(rendered: RenderedChats, per_turn: dict[int, list[RenderedChat]]) -> RenderedChats:
    """The samples, with those of the conversations in `per_turn` replaced by their per-turn samples."""
    samples = []
    for n in range(len(rendered)):
        samples.extend(per_turn[n] if n in per_turn else [rendered[n]])
    return RenderedChats.of(samples)


@dataclass(slots=True)
class _Batch:
    """A batch of conversations checked and normalized (`_check`), as columns."""

    tokenizer: PreTrainedTokenizerBase
    messages: list[list[dict[str, Any]]]
    tools: list[list[dict[str, Any]] | None]
    indices: list[int]
    roles: list[tuple[str, ...] | None]
    """The roles of each conversation that is only roles and texts, without tools (`_roles_and_texts`); else None."""
    contents: list[list[str] | None]
    """The texts of those conversations, in message order: with the roles, all that a skeleton needs of them."""
    untrained: list[frozenset[int]]
    """The positions of each conversation's replies marked `"weight": 0` (OpenAI's chat format): context only."""

    def chat(self, n: int) -> _Chat:
        """Conversation n, as the renderings that take it one at a time need it."""
        return _Chat(self.tokenizer, self.messages[n], self.tools[n], self.indices[n])


def _check(
    conversations: list[Any], tools: list[Any], indices: list[int], tokenizer: PreTrainedTokenizerBase
) -> _Batch:
    """Each conversation checked and normalized (`chat_messages`), with its tools parsed."""
    template = tokenizer.chat_template or ""
    field = reasoning_field(tokenizer)
    wraps_tool_results = _TOOL_RESPONSE[0] in template
    checked, parsed, roles, contents, untrained = [], [], [], [], []
    for messages, schemas, index in zip(conversations, tools, indices, strict=True):
        plain = _roles_and_texts(messages)
        skipped: frozenset[int] = frozenset()
        if plain is None:
            messages = chat_messages(messages, index)
            if wraps_tool_results:
                messages = [_unwrapped_tool_result(message) for message in messages]
            messages, skipped = _weights(messages, index)
            _check_rendered_fields(messages, template, index)
            messages = [_reasoning_for(message, field, f"sample {index}, message {n}") for n, message in
                        enumerate(messages)]  # fmt: skip
        if field is not None:
            apart = [_reasoning_apart(message, field, index) for message in messages]
            if any(map(operator.is_not, apart, messages)):
                messages, plain = apart, None
        schemas = chat_tools(schemas, index) if schemas is not None else None
        if schemas is not None:
            if "tools" not in template:
                raise FinetuneError(
                    f"sample {index} has tools, which the chat template never renders (it reads no `tools`): the "
                    "model would learn calls to tools it was never shown; set data.chat_template to a template that "
                    "renders tools, or drop the tools column (columns mapping)"
                )
            plain = None
        checked.append(messages)
        parsed.append(schemas)
        roles.append(plain[0] if plain is not None else None)
        contents.append(plain[1] if plain is not None else None)
        untrained.append(skipped)
    return _Batch(tokenizer, checked, parsed, indices, roles, contents, untrained)


_TOOL_RESPONSE = ("<tool_response>", "</tool_response>")


def _unwrapped_tool_result(message: dict[str, Any]) -> dict[str, Any]:
    """A tool result that the data wraps in the `<tool_response>` tags the template writes around every tool
    result itself (Hermes function-calling data on Qwen's and Hermes' templates) without them: the model sees
    one wrapper, as at inference, not two."""
    content = message.get("content")
    if message.get("role") != "tool" or not isinstance(content, str):
        return message
    opening, closing = _TOOL_RESPONSE
    inner = content.strip()
    if not (inner.startswith(opening) and inner.endswith(closing)):
        return message
    return {**message, "content": inner[len(opening) : -len(closing)].strip("\n")}


def _weights(messages: list[dict[str, Any]], index: int) -> tuple[list[dict[str, Any]], frozenset[int]]:
    """Messages without their `weight` key (OpenAI's chat format: 0 keeps an assistant turn as context only,
    1 trains it), and the positions of the replies of weight 0."""
    if not any("weight" in message for message in messages):
        return messages, frozenset()
    skipped = set()
    for number, message in enumerate(messages):
        weight = message.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool) or message["role"] != "assistant" and "weight" in message:
            raise FinetuneError(
                f"sample {index}, message {number}: weight {weight!r} on a {message['role']} message; weight is 0 (an "
                "assistant turn kept as context, not trained) or 1 (trained), on assistant messages only"
            )
        if weight == 0:
            skipped.add(number)
    return [{k: v for k, v in message.items() if k != "weight"} for message in messages], frozenset(skipped)


def _check_rendered_fields(messages: list[dict[str, Any]], template: str, index: int) -> None:
    """Tool calls go to templates that render them; a template that never reads them would drop them from
    the text without a word, and the reply would train as if no call had been made."""
    for number, message in enumerate(messages):
        if message.get("tool_calls") and "tool_calls" not in template:
            raise FinetuneError(
                f"sample {index}, message {number} has tool_calls, which the chat template never renders (it reads "
                "no `tool_calls`): they would be dropped from training; set data.chat_template to a template that "
                "renders tool calls, or write the calls into the reply's content"
            )


# The fields a reply's reasoning comes in, by the templates that read them: `reasoning_content` (Qwen3, DeepSeek-R1
# and most reasoning data), `thinking` (gpt-oss's harmony, which writes it on an analysis channel before the reply).
REASONING_FIELDS = ("reasoning_content", "thinking")


def reasoning_field(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The field the tokenizer's chat template writes a reply's reasoning from, or None if it writes none."""
    return _reasoning_field(_Renderer(tokenizer)) if tokenizer.chat_template else None


@functools.lru_cache(maxsize=8)
def _reasoning_field(render: _Renderer) -> str | None:
    # Rendered, not searched for: a template may name `thinking` for something else (Qwen3's `enable_thinking`).
    probe = _SENTINEL.format("probe")
    for field in REASONING_FIELDS:
        text = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", field: probe}])
        if text is not None and probe in text:
            return field
    return None


def _reasoning_for(message: dict[str, Any], field: str | None, where: str) -> dict[str, Any]:
    """The message with its reasoning where the template reads it: under the template's field whichever of the
    two the data used, or, for a template that reads none, as a leading <think> block of the content (as such
    data writes it), trained (or kept as context) and counted like any."""
    given = [name for name in REASONING_FIELDS if name in message]
    if not given:
        return message
    if len(given) > 1:
        raise FinetuneError(f"{where} has both {' and '.join(given)}; give its reasoning in one of them")
    if given[0] == field:
        return message
    reasoning = message[given[0]]
    rest = {key: value for key, value in message.items() if key != given[0]}
    if not str(reasoning).strip():
        return rest
    if field is not None:
        return {**rest, field: reasoning}
    return {**rest, "content": f"<think>\n{str(reasoning).strip()}\n</think>\n\n{message.get('content') or ''}"}


def _replies(messages: list[dict[str, Any]]) -> tuple[int, ...]:
    """The positions of the assistant messages."""
    return tuple(i for i, message in enumerate(messages) if message["role"] == "assistant")


def _render_all(batch: _Batch) -> list[str]:
    """Each conversation's text, rendered in one `apply_chat_template` call per set of tools (the
    per-call work of transformers is then paid once per batch, as a batched `datasets.map` pays it);
    a refused batch is rendered again one conversation at a time, to name the sample the template refuses."""
    if not batch.messages:
        return []
    texts = _render_batches(batch.messages, batch.tools, batch.tokenizer)
    if None in texts:
        return [text if text is not None else batch.chat(n).render() for n, text in enumerate(texts)]
    return texts


def _render_batches(
    conversations: list[list[dict[str, Any]]],
    tools: list[list[dict[str, Any]] | None],
    tokenizer: PreTrainedTokenizerBase,
) -> list[str | None]:
    """Render conversations (each with its tools) grouped by their tools; None where the template refuses one."""
    if not any(tools):  # no conversation has tools (most data): one group
        return _render_group(conversations, None, tokenizer)
    groups: dict[str, list[int]] = {}
    for n, schemas in enumerate(tools):
        groups.setdefault("" if schemas is None else json.dumps(schemas, sort_keys=True, default=str), []).append(n)
    texts: list[str | None] = [None] * len(conversations)
    for members in groups.values():
        batch = _render_group([conversations[n] for n in members], tools[members[0]], tokenizer)
        for n, text in zip(members, batch, strict=True):
            texts[n] = text
    return texts


def _render_group(
    conversations: list[list[dict[str, Any]]], tools: list[dict[str, Any]] | None, tokenizer: PreTrainedTokenizerBase
) -> list[str | None]:
    try:
        return tokenizer.apply_chat_template(conversations, tools=tools, tokenize=False)
    except Exception:  # jinja2 errors or the template's raise_exception: find which conversations
        return [_render_or_none(tokenizer, messages, tools) for messages in conversations]


def _render_or_none(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # the caller renders it again through _Chat.render, which names the sample
        return None


def _reasoning_apart(message: dict[str, Any], field: str, index: int = -1) -> dict[str, Any]:
    """An assistant message with a leading <think> block in its content, as the same message with the block
    in the template's reasoning `field`: templates that take `reasoning_content` render both alike (harmony
    writes `thinking` on its analysis channel, where a model trained on it reasons), and with the reasoning
    apart, the content alone can be replaced by a placeholder to locate the reply."""
    content = message.get("content")
    if message["role"] != "assistant" or field in message or not isinstance(content, str):
        return message
    if not content.lstrip().startswith("<think>"):
        return message
    if "</think>" not in content:
        raise unclosed_think(index)
    reasoning, _, answer = content.partition("</think>")
    return {**message, "content": answer.lstrip("\n"), field: reasoning.split("<think>", 1)[1].strip("\n")}


@dataclass(slots=True)
class _Chat:
    """One checked conversation, its tools, and its sample index: what every rendering of it needs."""

    tokenizer: PreTrainedTokenizerBase
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    index: int

    def render(self, messages: list[dict[str, Any]] | None = None, generation: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                self.messages if messages is None else messages, tools=self.tools, tokenize=False,
                add_generation_prompt=generation,
            )  # fmt: skip
        except Exception as exc:  # templates raise jinja2 errors, or their own via raise_exception
            self._check_call_turns(self.messages if messages is None else messages)
            raise FinetuneError(
                f"sample {self.index}: the tokenizer's chat template refuses it ({first_line(exc)}); fix or remove "
                "the sample"
            ) from None

    def _check_call_turns(self, messages: list[dict[str, Any]]) -> None:
        """Name the cause where a template refuses a turn of tool calls without text because it writes calls only
        for a null content (DeepSeek-R1's and V3's test `content is none`, then fail on a missing one): transformers
        leaves null keys out of what a template sees, so no data can give such a turn its calls."""
        bare = [n for n, message in enumerate(messages) if message.get("tool_calls") and "content" not in message]
        if not bare:
            return
        filled = [{**message, "content": ""} if n in bare else message for n, message in enumerate(messages)]
        try:
            self.tokenizer.apply_chat_template(filled, tools=self.tools, tokenize=False)
        except Exception:  # refused for another reason: the caller names the template's own error
            return
        raise FinetuneError(
            f"sample {self.index}, message {bare[0]}: the chat template writes a turn's tool calls only when its "
            "content is null (it tests `content is none`), and transformers leaves null keys out of what a template "
            "sees, so this turn's calls cannot be rendered; set data.chat_template to a template that tests "
            "`not message.content` instead"
        )

    def up_to(self, i: int) -> _Chat:
        return dataclasses.replace(self, messages=self.messages[: i + 1])


def _per_turn(chat: _Chat, shape: TemplateShape, replies: list[int]) -> list[RenderedChat]:
    """One sample per assistant reply: the conversation up to it, that reply trained."""
    samples = []
    for i in replies:
        turn = chat.up_to(i)
        text = turn.render()
        located = _reply_spans(turn, shape, [i], text)
        if located is None:
            raise FinetuneError(
                f"sample {chat.index}: the chat template renders even the conversation up to message {i} so that "
                "its last reply cannot be located; set data.completion_only_loss=false"
            )
        samples.append(RenderedChat(text, located[0], expanded=True, reasoning=located[1]))
    return samples


_PROBE_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}  # fmt: skip
_PROBE_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "probe"}}}
# The shapes agent and reasoning data take: several turns, reasoning on the last; a turn of parallel tool calls,
# their results, and an answer.
_PROBES = {
    "multi-turn replies with reasoning": [
        {"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"},
        {"role": "assistant", "content": "Second answer.", "reasoning_content": "Some thought."},
    ],
    "parallel tool calls, their results and an answer": [
        {"role": "user", "content": "Look two words up."},
        {"role": "assistant", "tool_calls": [_PROBE_CALL, _PROBE_CALL]},
        {"role": "tool", "content": "one result"}, {"role": "tool", "content": "another result"},
        {"role": "assistant", "content": "Both found."},
    ],
}  # fmt: skip


def probe_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """`finetune check`: the chat template tried on the shapes of conversation agent and reasoning data take (tool
    calls where it renders tools), each located exactly or said not to be, with the reason: data of that shape
    would be refused when it is tokenized."""
    if not tokenizer.chat_template:
        return "chat template: none (chat data needs data.chat_template)"
    located, problems = [], []
    for shape, conversation in _PROBES.items():
        calls = any(message.get("tool_calls") for message in conversation)
        if calls and "tool_calls" not in tokenizer.chat_template:
            continue  # a template that writes no calls: tool data is refused, and says why, when tokenized
        schemas = [[_PROBE_TOOL]] if calls and "tools" in tokenizer.chat_template else None
        try:
            render_chats([conversation], tokenizer, True, tools=schemas)
        except FinetuneError as exc:
            problems.append(f"{shape} ({str(exc).replace('sample 0', 'its probe', 1)})")
        else:
            located.append(shape)
    parts = [f"replies located exactly in {', in '.join(located)}"] if located else []
    parts += [f"cannot train {problem}" for problem in problems]
    return "chat template: " + "; ".join(parts)


def chat_tools(value: Any, index: int) -> list[dict[str, Any]] | None:
    """A sample's `tools`: JSON schemas as a list, or as JSON text; nulls that Arrow filled in are dropped."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise FinetuneError(f"sample {index}: tools is not valid JSON ({exc}); fix or remove the sample") from None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise FinetuneError(f"sample {index}: tools must be a list of JSON schemas, got {describe(value)}")
    return [_without_nulls(tool) for tool in value] or None


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def read_chat_template(value: str, named: dict[str, str] | None = None) -> str:
    """`data.chat_template`: a Jinja template written out, the path of a file holding one, or the name of
    one of the tokenizer's named templates (`named`, where its template is a dict). Anything else (a
    missing file, a name such as `chatml`) is refused rather than taken as a template whose text is that
    string; so is a template that cannot render a conversation's contents."""
    if named is not None and value in named:
        return named[value]
    if not _looks_like_jinja(value):
        path = Path(value).expanduser()
        if not path.is_file() and _looks_like_path(value):
            raise FinetuneError(
                f"data.chat_template {value} does not exist; point it at a template file, or write the template itself"
            )
        if not path.is_file():
            names = f" nor one of the tokenizer's named templates ({', '.join(sorted(named))})" if named else ""
            raise FinetuneError(
                f"data.chat_template {value} is neither a file nor a Jinja template{names}; point it at a template "
                "file (e.g. templates/chatml.jinja) or write the template itself"
            )
        value = path.read_text()
        if not value.strip():
            raise FinetuneError(
                f"data.chat_template file {path} is empty; write the template into it, or point at another file"
            )
    _check_renders(value)
    return value


def names_a_template(value: str) -> bool:
    """A `data.chat_template` value that can only be checked against the tokenizer: a bare name, which may be
    one of its named templates (`tool_use`), and is otherwise refused when the tokenizer loads."""
    return not _looks_like_jinja(value) and not _looks_like_path(value) and not Path(value).expanduser().exists()


def _looks_like_path(value: str) -> bool:
    """A `data.chat_template` value that names a file (a folder in it, or a template file's suffix): one that does
    not exist is missing, not a template's name."""
    return not re.fullmatch(r"[\w.-]+", value) or Path(value).suffix in (".jinja", ".j2", ".jinja2", ".txt")


def _looks_like_jinja(value: str) -> bool:
    return "{{" in value or "{%" in value


def _check_renders(template: str) -> None:
    """The template compiles and writes the contents of a conversation (with a system message where it
    takes one), so that a file of something else, or a template that ignores `messages`, is refused."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(template)
    except Exception as exc:  # jinja2.TemplateSyntaxError, with the line
        raise FinetuneError(f"data.chat_template is not a valid Jinja template ({first_line(exc)}); fix it") from None
    probe = [{"role": role, "content": _SENTINEL.format(role)} for role in ("system", "user", "assistant")]
    problem = ""
    for messages in (probe, probe[1:]):  # templates that refuse system messages are tried without one
        try:
            text = compiled.render(messages=messages, bos_token="", eos_token="", add_generation_prompt=False)
        except Exception as exc:  # jinja2 errors, or the template's own raise_exception
            problem = first_line(exc)
            continue
        missing = [m["role"] for m in messages if m["content"] not in text]
        if not missing:
            return
        problem = f"it writes no {' or '.join(missing)} message content"
    raise FinetuneError(
        f"data.chat_template cannot render a conversation of system, user and assistant messages ({problem}); "
        "give a chat template that writes each message's content"
    )


def _roles_and_texts(messages: Any) -> tuple[tuple[str, ...], list[str]] | None:
    """The roles and the texts of a conversation whose messages are each a role (not a tool's) and a non-empty
    text, and nothing else, as most data is: `chat_messages` would return it as it is, and a skeleton keyed by
    its roles, filled with its texts, renders it. None for any other conversation."""
    if type(messages) is not list or not messages:
        return None
    roles, texts = [], []
    for message in messages:  # a plain loop: the quickest way through every message of a dataset
        if type(message) is not dict or len(message) != 2:
            return None
        role, text = message.get("role"), message.get("content")
        if type(role) is not str or type(text) is not str or not text or role == "tool":
            return None
        roles.append(role)
        texts.append(text)
    return tuple(roles), texts


def chat_messages(messages: Any, index: int) -> list[dict[str, Any]]:
    """One conversation as chat templates take it, or a data error naming the sample.

    Content given as a list of parts (`[{"type": "text", "text": ...}]`) becomes its text, as
    multimodal-style templates render it; a part that is not text cannot be trained on here. Keys
    whose value is null are dropped: Arrow gives every message the keys any message has, and a
    template testing `message.tool_calls is defined` must not see a null one. ShareGPT turns
    (`from` / `value`) become role / content messages.
    """
    where = f"sample {index}"
    if isinstance(messages, list):
        try:
            messages = [_from_sharegpt(message) for message in messages]
        except FinetuneError as exc:
            raise FinetuneError(f"{where}: {exc}") from None
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
        empty = not str(message.get("content") or "").strip()
        if message["role"] == "assistant" and empty and not message.get("tool_calls"):
            raise FinetuneError(
                f"{where}, message {number} is an empty assistant reply: there is nothing to train on; give it "
                "text (or tool_calls), or remove the sample"
            )
        if message.get("tool_calls"):
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}, message {number}")
        if message["role"] == "tool" and not (normalized and normalized[-1]["role"] in ("assistant", "tool")):
            raise FinetuneError(
                f"{where}, message {number} is a tool result that answers no tool call (the message before it is "
                "not an assistant's); fix or remove the sample"
            )
        normalized.append(message)
    return normalized


def _tool_calls(calls: Any, where: str) -> Any:
    """Tool calls with their `arguments` as objects, as chat templates expect them (most write them with
    `tojson`): arguments given as JSON text (OpenAI's wire format) are parsed, where they would otherwise be
    written as a quoted string; text that is not a JSON object is refused."""
    if not isinstance(calls, list):
        return calls
    parsed = []
    for call in calls:
        holder = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
        arguments = holder.get("arguments") if isinstance(holder, dict) else None
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except json.JSONDecodeError as exc:
                value, problem = None, str(exc)
            else:
                problem = None if isinstance(value, dict) else f"a {type(value).__name__}, not an object"
            if problem is not None:
                raise FinetuneError(
                    f"{where}: the arguments of tool call {holder.get('name')!r} are not a JSON object ({problem}); "
                    "fix or remove the sample"
                )
            holder = {**holder, "arguments": value}
            call = {**call, "function": holder} if holder is not call else holder
        parsed.append(call)
    return parsed


# ShareGPT's speakers (`from`), as chat templates name the roles: its own names and those of the datasets
# written in it (glaive/Hermes function calling, Cohere, OpenAI's older `function` role). Others are refused.
_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "model": "assistant", "assistant": "assistant",
    "chatbot": "assistant", "bot": "assistant", "system": "system", "tool": "tool", "function_response": "tool",
    "observation": "tool", "function": "tool", "ipython": "tool",
    # A call written as the turn's text (glaive): the reply, trained as text with its call.
    "function_call": "assistant",
}  # fmt: skip


def message_role(message: Any) -> str | None:
    """A message's chat role, ShareGPT's speakers read as the roles they stand for; None for a non-message."""
    if not isinstance(message, dict):
        return None
    return message.get("role") or _SHAREGPT_ROLES.get(message.get("from"))


def _from_sharegpt(message: Any) -> Any:
    """A ShareGPT turn ({"from": "human" | "gpt" | "system" | "tool", "value": ...}) as a chat message; other
    values as they are. Tool calls written into a reply's text (as Hermes-style data has them) stay text,
    trained with the reply."""
    if not isinstance(message, dict) or message.get("role") is not None or "from" not in message:
        return message
    turn = {key: value for key, value in message.items() if key not in ("from", "value", "role")}
    speaker = message["from"]
    if speaker not in _SHAREGPT_ROLES:
        raise FinetuneError(
            f"a ShareGPT turn is from {speaker!r}, a speaker finetune does not know; it reads "
            f"{', '.join(sorted(_SHAREGPT_ROLES))}: rename it in the data"
        )
    return {"role": _SHAREGPT_ROLES[speaker], "content": message.get("value"), **turn}


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


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


@dataclass(frozen=True)
class TemplateShape:
    """What a chat template writes around replies, learned by rendering placeholder conversations."""

    reply_prefix: str
    """After a user message's content, up to where the assistant's reply begins: the user turn's end
    and the assistant header (the generation prompt), e.g. "<|im_end|>\\n<|im_start|>assistant\\n"."""
    generation_prompt: str
    """What add_generation_prompt appends (may be empty, as for Mistral)."""
    end_marker: str
    """What closes an assistant turn, through its first special token (e.g. "<|im_end|>"), or "" if the
    template closes assistant turns with nothing it closes user turns with."""
    last_end_marker: str = ""
    """What closes the reply that ends a conversation, through its first special token, where the template
    closes that one otherwise (gpt-oss's harmony: `<|return|>`, the token generation stops at, for `<|end|>`)."""
    headers: tuple[str, ...] = ()
    """What may open an assistant turn, the longest first: the reply prefix and the generation prompt, and both
    less a think tag the generation prompt ends with. A prompt that opens the reasoning (QwQ's, DeepSeek-R1's
    `<think>\n`) or closes it (non-thinking modes' `</think>`) is written so for the reply being generated only:
    an earlier turn, or a turn of tool calls, opens without it, and all it writes after the rest of the header
    (its calls' wrappers, an empty think block) is what the model generated in that turn."""


_SENTINEL = "\ue000{}\ue001"  # private-use characters: in no template, untouched by trim


def template_shape(tokenizer: PreTrainedTokenizerBase) -> TemplateShape:
    """The reply prefix, generation prompt and end marker of the tokenizer's template (cached per template)."""
    specials = tuple(sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len))
    return _template_shape(tokenizer.chat_template, specials, _Renderer(tokenizer))


class _Renderer:
    """Hashable by template, so that the shape is learned once per template, not per batch."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer

    def __hash__(self) -> int:
        return hash(self.tokenizer.chat_template)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Renderer) and other.tokenizer.chat_template == self.tokenizer.chat_template

    def __call__(self, messages: list[dict[str, str]], generation: bool = False, tools: Any = None) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation
            )
        except Exception:  # a template that refuses the probe conversation: that part of the shape stays empty
            return None


@functools.lru_cache(maxsize=8)
def _template_shape(template: str, specials: tuple[str, ...], render: _Renderer) -> TemplateShape:
    user, reply, user2 = (_SENTINEL.format(f"probe{i}") for i in range(3))
    # Probed without tools, or with one where the template renders nothing without (Hermes-3's and Command-R's
    # tool-use templates raise): its layout is learned either way, never left empty.
    tools = None
    if render([{"role": "user", "content": user}], generation=True) is None:
        tools = [_PROBE_TOOL] if render([{"role": "user", "content": user}], True, [_PROBE_TOOL]) else None
    render = functools.partial(render, tools=tools)
    prompt = render([{"role": "user", "content": user}], generation=True) or ""
    bare = render([{"role": "user", "content": user}]) or ""
    generation_prompt = prompt[len(bare) :] if prompt.startswith(bare) else ""
    reply_prefix = prompt.split(user, 1)[1] if user in prompt else ""
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    # What follows a reply: before the next user turn, or (templates that render earlier replies
    # differently) at the end of the text.
    closing = render([*turns, {"role": "user", "content": user2}]) or ""
    if reply not in closing or user2 not in closing:
        closing = (render(turns) or "") + user2
    after_reply = closing.split(reply, 1)[1].split(user2, 1)[0] if reply in closing else ""
    ending = render(turns) or ""
    after_last = ending.split(reply, 1)[1] if reply in ending else ""
    full = [header for header in (reply_prefix, generation_prompt) if header]
    headers = dict.fromkeys([*full, *(_without_think_tag(header) for header in full)])
    # The end of a turn: what the template writes after a reply both before the next turn and at the end of the
    # conversation, through its last special token (Command-R's `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`: both
    # are the reply's); where those differ from the first character, through the first special token after it.
    shared = _through_last_special(os.path.commonprefix([after_reply, after_last]), specials)
    return TemplateShape(
        reply_prefix, generation_prompt, shared or _through_first_special(after_reply, specials),
        _through_first_special(after_last, specials), tuple(header for header in headers if header),
    )  # fmt: skip


def _through_last_special(text: str, specials: tuple[str, ...]) -> str:
    """`text` through its last special token, or "" without one."""
    ends = [text.rfind(token) + len(token) for token in specials if token and token in text]
    return text[: max(ends)] if ends else ""


def _without_think_tag(header: str) -> str:
    """`header` less the think tag (and whitespace around it) it ends with, or "" if it ends with none."""
    stripped = header.rstrip()
    for tag in ("<think>", "</think>"):
        if stripped.endswith(tag):
            return stripped[: -len(tag)]
    return ""


def _through_first_special(text: str, specials: tuple[str, ...]) -> str:
    """`text` through its first special token (the longest, where several start there), or "" without one: what
    the template writes to close a reply, when it writes a marker there."""
    found = [(text.find(token), token) for token in specials if token and token in text]
    position, token = min(found, default=(-1, ""), key=lambda pair: (pair[0], -len(pair[1])))
    return text[: position + len(token)] if position >= 0 else ""


def _reply_spans(
    chat: _Chat, shape: TemplateShape, trained: list[int], text: str
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """Character spans in `text` of the replies `trained` (message positions), and of the reasoning
    inside them, or None when the template's rendering does not let them be located (see `render_chats`)."""
    placeholders = list(chat.messages)
    names = {}  # reply -> the call name its placeholder stands for (a reply of tool calls only)
    calls = {}  # reply -> the name of the first call of a reply with text and calls, and the placeholder in its place
    for k, i in enumerate(trained):
        replaced = _with_placeholder(chat.messages[i], _SENTINEL.format(k))
        if replaced is None:
            return None
        message = replaced[0]
        if not chat.messages[i].get("content"):
            names[k] = replaced[1]
        elif message.get("tool_calls") and (named := _with_placeholder({"tool_calls": message["tool_calls"]},
                                                                       _SENTINEL.format(f"n{k}"))):  # fmt: skip
            message = {**message, "tool_calls": named[0]["tool_calls"]}
            calls[k] = named[1], _SENTINEL.format(f"n{k}")
        if (field := _reasoning_of(message)) is not None:
            message = {**message, field: _SENTINEL.format(f"r{k}")}
        placeholders[i] = message
    marked = chat.render(placeholders)
    for k, (name, placeholder) in calls.items():
        if placeholder not in marked:
            raise FinetuneError(
                f"sample {chat.index}, message {trained[k]}: the chat template writes no tool calls for an assistant "
                "turn that has text (its reasoning or words before the calls), so this turn's calls would be neither "
                "seen nor trained; move that text to a turn of its own, or set data.chat_template to a template that "
                "renders both"
            )
        marked = marked.replace(placeholder, name)
    for k, name in names.items():
        # Templates that name the call again in its result's header (harmony's `functions.get_weather to=...`,
        # gemma-4's): the first place is the call's; the later ones are template text, the name as written.
        placeholder = _SENTINEL.format(k)
        first = marked.find(placeholder) + len(placeholder)
        if first >= len(placeholder):
            marked = marked[:first] + marked[first:].replace(placeholder, name)
    # The placeholders in the order the template wrote them: every reply once, its reasoning once or
    # not at all (templates drop the reasoning of earlier replies).
    found = []
    for k, i in enumerate(trained):
        for kind, placeholder in (("reasoning", _SENTINEL.format(f"r{k}")), ("reply", _SENTINEL.format(k))):
            count = marked.count(placeholder)
            if kind == "reply" and count == 0 and chat.messages[i].get("tool_calls") and k not in names:
                raise FinetuneError(
                    f"sample {chat.index}, message {i}: the chat template writes no text for an assistant turn that "
                    "makes tool calls, so this turn's text (its reasoning or words before the calls) would be "
                    "neither seen nor trained; move that text to a turn of its own or remove it, or set "
                    "data.chat_template to a template that renders it"
                )
            if count > 1 or (kind == "reply" and count == 0):
                return None
            if count:
                found.append((marked.index(placeholder), kind, k, placeholder))
    found.sort()
    if [k for _, kind, k, _ in found if kind == "reply"] != list(range(len(trained))):
        return None
    segments, previous = [], 0
    for at, _, _, placeholder in found:
        segments.append(marked[previous:at])
        previous = at + len(placeholder)
    segments.append(marked[previous:])
    if not (text.startswith(segments[0]) and text.endswith(segments[-1])):
        return None
    # Where each placeholder's real text lies: between the template text before and after it.
    regions: _Regions = {}
    position, end_of_text = len(segments[0]), len(text) - len(segments[-1])
    for j, (_, kind, k, _) in enumerate(found):
        following = segments[j + 1]
        end = end_of_text if j == len(found) - 1 else text.find(following, position)
        if end < position or end > end_of_text:
            return None
        regions[kind, k] = (position, end, j)
        position = end + len(following)
    return _spans(text, regions, shape, len(trained))


_Regions = dict[tuple[str, int], tuple[int, int, int]]
"""(kind, reply) -> where the reply's content ("reply") or reasoning lies in the text: start, end, and
its number in the order the template wrote them. The template's own text lies between regions."""


def _spans(
    text: str, regions: _Regions, shape: TemplateShape, replies: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The trained span of each reply, from its assistant header through its turn's end marker, and
    the spans of the reasoning inside them."""
    # The template's text before region j runs from the end of region j - 1 (or 0) to its start.
    bounds = {j: (start, end) for start, end, j in regions.values()}
    spans, reasoning = [], []
    for k in range(replies):
        content_start, content_end, j = regions["reply", k]
        thought = regions.get(("reasoning", k))
        first_start, _, first = thought if thought is not None and thought[2] < j else (content_start, content_end, j)
        start = _reply_start(text, bounds[first - 1][1] if first else 0, first_start, shape)
        following_end = bounds[j + 1][0] if j + 1 in bounds else len(text)
        marker = text.find(shape.end_marker, content_end, following_end) if shape.end_marker else -1
        end = marker + len(shape.end_marker) if marker >= 0 else content_end
        if marker < 0 and following_end == len(text) and shape.last_end_marker:
            # The conversation's last reply, closed as only a last one is (harmony's <|return|>): trained too.
            last = text.find(shape.last_end_marker, content_end)
            end = last + len(shape.last_end_marker) if last >= 0 else end
        spans.append((start, end))
        if thought is not None:
            reasoning.append(thought[:2])
        elif (think := _think_block(text, content_start, content_end)) is not None:
            reasoning.append(think)
    return spans, reasoning


class _Skeleton:
    """A conversation rendered with a placeholder in place of every message's content (and reasoning):
    the template's text, which conversations of the same structure share, as pieces alternating
    between template text and placeholder names (c<i> the content of message i, r<i> its reasoning)."""

    def __init__(self, pieces: list[str], replies: tuple[int, ...], shape: TemplateShape, messages: int | None):
        """`replies`: the positions of the assistant messages, as in every conversation of this structure;
        `messages`: their number where conversations give their texts as the list of contents (roles and
        texts only), None where they give them by placeholder name."""
        self.pieces, self.replies, self.shape = pieces, replies, shape
        names = pieces[1::2]
        self.kinds = {name[0] for name in names}
        """"c" (contents), and "r" where the template wrote reasoning given apart."""
        self.keys: list[Any] = names if messages is None else [int(name[1:]) for name in names]
        """Where each placeholder's text is in a conversation's texts."""
        self.in_order = messages is not None and self.keys == list(range(messages))
        """Every content once, in message order, as most templates write them: the texts are the contents."""
        self._placed: dict[tuple[int, ...], tuple[list[tuple[int, str, int]] | None, list[_Laid] | None]] = {}

    def placed(self, trained: tuple[int, ...]) -> tuple[list[tuple[int, str, int]] | None, list[_Laid] | None]:
        """Where the replies `trained` (message positions) stand among the pieces, the same for every
        conversation of this skeleton: their plan, (piece number, "reply" or "reasoning", reply) in
        the order written, or None if a reply's content is not there exactly once, its reasoning more
        than once, or the replies are out of order; and their layout (`_layout`)."""
        placed = self._placed.get(trained)
        if placed is None:
            plan = self._plan(trained)
            placed = self._placed[trained] = (plan, self._layout(plan, len(trained)) if plan is not None else None)
        return placed

    def _plan(self, trained: tuple[int, ...]) -> list[tuple[int, str, int]] | None:
        where: dict[str, list[int]] = {}
        for n in range(1, len(self.pieces), 2):
            where.setdefault(self.pieces[n], []).append(n)
        found = []
        for k, i in enumerate(trained):
            content, reasoning = where.get(f"c{i}", []), where.get(f"r{i}", [])
            if len(content) != 1 or len(reasoning) > 1:
                return None
            found += [(content[0], "reply", k)] + [(n, "reasoning", k) for n in reasoning]
        found.sort()
        return found if [k for _, kind, k in found if kind == "reply"] == list(range(len(trained))) else None

    def _layout(self, plan: list[tuple[int, str, int]], replies: int) -> list[_Laid] | None:
        """Where each reply's span starts and ends relative to the pieces, when the template text right
        before it holds its header and the text right after it its end marker: then `_spans` finds them
        there in every conversation of this skeleton (a match further out is never the last header or
        the first marker), and the spans are sums of piece lengths. None where a search would have to
        look beyond those pieces, into the texts."""
        at = {(kind, k): n for n, kind, k in plan}
        laid = []
        for k in range(replies):
            content, thought = at["reply", k], at.get(("reasoning", k), -1)
            first = thought if 0 <= thought < content else content
            header = _header_end(self.pieces[first - 1], self.shape)
            after, shape = self.pieces[content + 1], self.shape
            marker = after.find(shape.end_marker) if shape.end_marker else 0
            end = marker + len(shape.end_marker)
            if marker < 0 and content + 1 == len(self.pieces) - 1 and shape.last_end_marker:
                last = after.find(shape.last_end_marker)  # the conversation's last reply, closed as `_spans` says
                marker, end = last, last + len(shape.last_end_marker)
            if header is None or marker < 0:
                return None
            laid.append(_Laid(first - 1, header, content + 1, end, content, thought))
        return laid


class _Laid(NamedTuple):
    """A trained reply in a skeleton's pieces: its span runs from `start` characters into piece `start_piece`
    to `end` characters into piece `end_piece`; its content is piece `content`, its reasoning piece
    `reasoning` (-1 if the template wrote none)."""

    start_piece: int
    start: int
    end_piece: int
    end: int
    content: int
    reasoning: int


def _header_end(template_text: str, shape: TemplateShape) -> int | None:
    """Where `_reply_start` would find a reply's start inside the template text before it, or None where it
    would search further back (no header is in that text)."""
    if not shape.headers:
        return len(template_text)
    end = _last_header_end(template_text, 0, len(template_text), shape.headers)
    return end if end >= 0 else None


def _last_header_end(text: str, start: int, end: int, headers: tuple[str, ...]) -> int:
    """The end of the header in text[start:end] that ends last (the longest where several end together: the
    whole generation prompt before a part of it), or -1."""
    found = -1
    for header in headers:
        at = text.rfind(header, start, end)
        if at >= 0:
            found = max(found, at + len(header))
    return found


_PLACEHOLDER = re.compile("\ue000([cr][0-9]+)\ue001")

_Texts = list[str] | dict[str, str]
"""A conversation's texts that fill its skeleton: the contents in message order (roles and texts only), or
by placeholder name."""


def _skeletons(batch: _Batch, shape: TemplateShape) -> list[tuple[_Skeleton | None, _Texts]]:
    """The skeleton of each conversation, rendered once per distinct structure in the batch (roles,
    tool calls, tools: everything but the texts), so that locating replies costs no second rendering
    of each conversation (None where the template refuses the placeholders), and the texts that fill it."""
    if not batch.messages:
        return []
    keys: list[Any] = []
    fillings: list[_Texts] = []
    structures: dict[Any, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int | None]] = {}
    for roles, contents, conversation, tools in zip(
        batch.roles, batch.contents, batch.messages, batch.tools, strict=True
    ):
        if roles is not None:  # roles and texts only: the roles are the structure, the texts fill it in order
            key: Any = roles
            values: _Texts = contents
            if key not in structures:
                messages = [{"role": role, "content": _SENTINEL.format(f"c{i}")} for i, role in enumerate(key)]
                structures[key] = (messages, None, len(messages))
        else:
            messages, values = [], {}
            for i, message in enumerate(conversation):
                message, texts = _placeholders(message, i)
                messages.append(message)
                values.update(texts)
            key = repr((messages, tools))
            structures.setdefault(key, (messages, tools, None))
        keys.append(key)
        fillings.append(values)
    structure = list(structures.values())
    rendered = _render_batches([s[0] for s in structure], [s[1] for s in structure], batch.tokenizer)
    skeletons = {
        key: _Skeleton(_PLACEHOLDER.split(text), _replies(messages), shape, count) if text is not None else None
        for key, (messages, _, count), text in zip(structures, structure, rendered, strict=True)
    }
    return [(skeletons[key], values) for key, values in zip(keys, fillings, strict=True)]


def _placeholders(message: dict[str, Any], i: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Message i with placeholders in place of its texts, and the texts they stand for by placeholder name."""
    values = {}
    replaced = _with_placeholder(message, _SENTINEL.format(f"c{i}"))
    if replaced is not None:
        message, values[f"c{i}"] = replaced
    if (field := _reasoning_of(message)) is not None:
        message, values[f"r{i}"] = {**message, field: _SENTINEL.format(f"r{i}")}, message[field]
    return message, values


def _reasoning_of(message: dict[str, Any]) -> str | None:
    """The field holding a message's reasoning as text (checked messages have at most one), or None."""
    for field in REASONING_FIELDS:
        reasoning = message.get(field)
        if isinstance(reasoning, str) and reasoning.strip():
            return field
    return None


def _filled_spans(
    skeleton: _Skeleton, values: _Texts, trained: tuple[int, ...], text: str
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """The replies' spans when the skeleton filled with the conversation's texts (`values`) is exactly
    the rendered text (the template copies texts as they are: no trimming, no branching on them), each
    placeholder then standing where its text lies; None otherwise, to locate them by `_reply_spans`."""
    plan, layout = skeleton.placed(trained)
    parts = skeleton.pieces.copy()
    try:
        parts[1::2] = values if skeleton.in_order else [values[key] for key in skeleton.keys]
    except KeyError:  # a placeholder-like text the data itself carried into the skeleton
        return None
    if plan is None or "".join(parts) != text:
        return None
    if layout is None:
        starts = list(itertools.accumulate(map(len, parts), initial=0))  # part n of the text starts at starts[n]
        regions: _Regions = {(kind, k): (starts[n], starts[n + 1], j) for j, (n, kind, k) in enumerate(plan)}
        return _spans(text, regions, skeleton.shape, len(trained))
    # Part n of the text starts at sum(lengths[:n]), summed only where a span needs it; plain loops, as
    # comprehensions are calls of their own before Python 3.12: this runs for every conversation of a dataset.
    lengths = list(map(len, parts))
    spans, reasoning = [], []
    for first, start, last, end, _, _ in layout:
        spans.append((sum(lengths[:first]) + start, sum(lengths[:last]) + end))
    if "<think>" in text or "r" in skeleton.kinds:
        for _, _, _, _, content, thought in layout:
            if thought >= 0:
                at = sum(lengths[:thought])
                reasoning.append((at, at + lengths[thought]))
            elif think := _think_block(text, at := sum(lengths[:content]), at + lengths[content]):
                reasoning.append(think)
    return spans, reasoning


def unclosed_think(index: int) -> FinetuneError:
    return FinetuneError(
        f"sample {index}: a reply opens <think> and never closes it (a trace cut off by a generation limit?), so "
        "its reasoning and its answer cannot be told apart; close the block with </think> or remove the sample"
    )


def _think_block(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The reasoning of a reply whose content opens with a <think> block the template kept as it was."""
    opened = text.find("<think>", start, end)
    if opened < 0 or text[start:opened].strip():
        return None
    closed = text.find("</think>", opened, end)
    if closed < 0:
        raise _UnclosedThink
    return opened + len("<think>"), closed


class _UnclosedThink(Exception):
    """A reply's think block has no end; `render_chats` names the sample (`unclosed_think`)."""


def _with_placeholder(message: dict[str, Any], placeholder: str) -> tuple[dict[str, Any], str] | None:
    """The message with `placeholder` in place of its content or, for a reply that is only tool calls, in
    place of its first call's name (its span still runs from the assistant header to the end marker),
    and the text the placeholder replaced."""
    if message.get("content"):
        return {**message, "content": placeholder}, message["content"]
    calls = message.get("tool_calls") or []
    call = calls[0] if calls and isinstance(calls[0], dict) else None
    if call is None:
        return None
    if isinstance(call.get("function"), dict) and isinstance(call["function"].get("name"), str):
        name = call["function"]["name"]
        call = {**call, "function": {**call["function"], "name": placeholder}}
    elif isinstance(call.get("name"), str):
        name, call = call["name"], {**call, "name": placeholder}
    else:
        return None
    return {**message, "tool_calls": [call, *calls[1:]]}, name


def _reply_start(text: str, start: int, end: int, shape: TemplateShape) -> int:
    """Where a reply begins in the template text text[start:end] before it: after its last assistant header."""
    found = _last_header_end(text, start, end, shape.headers)
    return found if found >= 0 else end
