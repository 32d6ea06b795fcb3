"""The common path: a batch's structure rendered once with a placeholder for every text; a conversation whose
rendering is the skeleton filled with its texts has its replies located without rendering it again."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from finetune.data.chat.messages import reasoning_of
from finetune.data.chat.rendering import ChatBatch, prompt_after, render_batches, reply_positions
from finetune.data.chat.spans import Around, Prompt, Regions, header_end, spans_of, think_block, turn_end
from finetune.data.chat.templates import SENTINEL, TemplateShape


class _Skeleton:
    """A conversation rendered with a placeholder in place of every message's content (and reasoning):
    the template's text, which conversations of the same structure share, as pieces alternating
    between template text and placeholder names (c<i> the content of message i, r<i> its reasoning)."""

    def __init__(
        self,
        pieces: list[str],
        replies: tuple[int, ...],
        shape: TemplateShape,
        messages: int | None,
        prompt_before: Callable[[int], Prompt | None],
        calls: tuple[int, ...] = (),
    ):
        """`replies`: the positions of the assistant messages, as in every conversation of this structure;
        `messages`: their number where conversations give their texts as the list of contents (roles and
        texts only), None where they give them by placeholder name; `prompt_before(i)`: what the template
        writes after message i - 1's placeholder to prompt reply i."""
        self.pieces, self.replies, self.shape = pieces, replies, shape
        self.prompt_before = functools.cache(prompt_before)
        self.calls = calls
        """How many tool calls each message makes (none where the conversations are roles and texts)."""
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
            placed = self._placed[trained] = (plan, self._layout(plan, trained) if plan is not None else None)
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

    def _layout(self, plan: list[tuple[int, str, int]], trained: tuple[int, ...]) -> list[_Laid] | None:
        """Where each reply's span starts and ends relative to the pieces, when the template text right
        before it holds its header and the text right after it its end marker: then `spans_of` finds them
        there in every conversation of this skeleton (a match further out is never the last header or
        the first marker), and the spans are sums of piece lengths. None where a search would have to
        look beyond those pieces, into the texts."""
        at = {(kind, k): n for n, kind, k in plan}
        laid = []
        for k, i in enumerate(trained):
            content, thought = at["reply", k], at.get(("reasoning", k), -1)
            first = thought if 0 <= thought < content else content
            header = header_end(self.pieces[first - 1], self.shape, self.prompt_before(i))
            after, shape = self.pieces[content + 1], self.shape
            calls = self.calls[i] if self.calls else 0
            marker, closing = turn_end(after, shape, 0, len(after), calls) if shape.end_markers else (0, "")
            end = marker + len(closing)
            if marker < 0 and content + 1 == len(self.pieces) - 1 and shape.last_end_marker:
                last = after.find(shape.last_end_marker)  # the conversation's last reply, closed as `spans_of` says
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


_PLACEHOLDER = re.compile("\ue000([cr][0-9]+)\ue001")


_Texts = list[str] | dict[str, str]
"""A conversation's texts that fill its skeleton: the contents in message order (roles and texts only), or
by placeholder name."""


def skeletons_of(batch: ChatBatch, shape: TemplateShape) -> list[tuple[_Skeleton | None, _Texts]]:
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
                messages = [{"role": role, "content": SENTINEL.format(f"c{i}")} for i, role in enumerate(key)]
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
    rendered = render_batches([s[0] for s in structure], [s[1] for s in structure], batch.tokenizer)
    skeletons = {
        key: _Skeleton(
            _PLACEHOLDER.split(text), reply_positions(messages), shape, count,
            functools.partial(_prompt_before, batch.tokenizer, messages, tools),
            tuple(len(message.get("tool_calls") or []) for message in messages),
        ) if text is not None else None
        for key, (messages, tools, count), text in zip(structures, structure, rendered, strict=True)
    }  # fmt: skip
    return [(skeletons[key], values) for key, values in zip(keys, fillings, strict=True)]


def _placeholders(message: dict[str, Any], i: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Message i with placeholders in place of its texts, and the texts they stand for by placeholder name."""
    values = {}
    replaced = with_placeholder(message, SENTINEL.format(f"c{i}"))
    if replaced is not None:
        message, values[f"c{i}"] = replaced
    if (field := reasoning_of(message)) is not None:
        message, values[f"r{i}"] = {**message, field: SENTINEL.format(f"r{i}")}, message[field]
    return message, values


def filled_spans(
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
        regions: Regions = {(kind, k): (starts[n], starts[n + 1], j) for j, (n, kind, k) in enumerate(plan)}
        # Each reply's header is after the text of the message before it (the piece before its first placeholder),
        # and its turn ends before the text of the message after it (the placeholder after its content's).
        firsts = {k: n for n, _, k in sorted(plan, reverse=True)}
        contents = {k: n for n, kind, k in plan if kind == "reply"}
        around = [
            Around(starts[firsts[k] - 1], starts[min(contents[k] + 2, len(parts))], skeleton.prompt_before(i),
                   skeleton.calls[i] if skeleton.calls else 0)
            for k, i in enumerate(trained)
        ]  # fmt: skip
        return spans_of(text, regions, skeleton.shape, around)
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
            elif think := think_block(text, at := sum(lengths[:content]), at + lengths[content]):
                reasoning.append(think)
    return spans, reasoning


def with_placeholder(message: dict[str, Any], placeholder: str) -> tuple[dict[str, Any], str] | None:
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


def _prompt_before(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, i: int
) -> Prompt | None:
    return prompt_after(tokenizer, messages[:i], tools)
