"""Where a reply lies in a rendered text: from the end of its assistant header through its end-of-turn marker,
with the reasoning inside it."""

from __future__ import annotations

import os
from typing import NamedTuple

from finetune.data.chat.templates import TemplateShape

Prompt = tuple[str, tuple[int, ...]]
"""What a template writes after a message's text to prompt the reply that follows it (the rest of the message's
turn and the generation prompt), and where its tokens end: a reply starts where the text stops following it."""

Regions = dict[tuple[str, int], tuple[int, int, int]]
"""(kind, reply) -> where the reply's content ("reply") or reasoning lies in the text: start, end, and
its number in the order the template wrote them. The template's own text lies between regions."""


class Around(NamedTuple):
    """What lies around a trained reply in its rendered text (`spans_of`), as far as it is known."""

    floor: int
    """Where the text of the message before it ends (0: not known): its header is after it (a template that
    writes a header before a tool's result, as DeepSeek-R1's `<｜Assistant｜>`, does not open the reply after the
    result with it)."""
    ceiling: int
    """Where the text of the message after it begins (the text's end: not known): its turn ends before it."""
    prompt: Prompt | None
    """What the template writes after the previous message's text to prompt the reply, where known."""
    calls: int
    """How many tool calls the reply makes."""
    call_at: tuple[int, int] | None = None
    """Where its first call's name lies, for a reply with words and calls whose call was located."""


def spans_of(
    text: str, regions: Regions, shape: TemplateShape, around: list[Around]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The trained span of each reply (one per `around`), from its assistant header through its turn's end
    marker, and the spans of the reasoning inside them."""
    # The template's text before region j runs from the end of region j - 1 (or 0) to its start.
    bounds = {j: (start, end) for start, end, j in regions.values()}
    spans, reasoning = [], []
    for k, known in enumerate(around):
        content_start, content_end, j = regions["reply", k]
        call = known.call_at
        if call is not None and call[1] <= content_start and not text[content_start:content_end].strip():
            # A template that writes a turn's calls, closes the turn, and then writes its words apart, blank here
            # (DeepSeek-R1's, for a turn whose words were all reasoning it drops): the turn is its calls.
            content_start, content_end = call
        thought = regions.get(("reasoning", k))
        first_start, _, first = thought if thought is not None and thought[2] < j else (content_start, content_end, j)
        after_region = bounds[first - 1][1] if first else 0
        floor = min(max(after_region, known.floor), first_start)
        start = _reply_start(text, floor, first_start, shape, known.prompt if known.floor >= after_region else None)
        following_end = bounds[j + 1][0] if j + 1 in bounds else len(text)
        following_end = min(following_end, known.ceiling)
        marker, closing = turn_end(text, shape, content_end, following_end, known.calls)
        end = marker + len(closing) if marker >= 0 else content_end
        if marker < 0 and known.calls and following_end < len(text):
            # A turn of calls the template closes with nothing before the next message: its arguments are the
            # model's, through where the next turn opens.
            opened = text.rfind(shape.turn_opener, content_end, following_end) if shape.turn_opener else -1
            end = opened if opened >= 0 else end
        if marker < 0 and following_end == len(text) and shape.last_end_marker:
            # The conversation's last reply, closed as only a last one is (harmony's <|return|>): trained too.
            last = text.find(shape.last_end_marker, content_end)
            end = last + len(shape.last_end_marker) if last >= 0 else end
        spans.append((start, end))
        if thought is not None:
            reasoning.append(thought[:2])
        elif (think := think_block(text, content_start, content_end)) is not None:
            reasoning.append(think)
    return spans, reasoning


def _first_of(text: str, markers: tuple[str, ...], start: int, end: int) -> tuple[int, str]:
    """The first of `markers` in text[start:end] (the longest where several start there), and where, or -1."""
    found = [(at, -len(marker), marker) for marker in markers if (at := text.find(marker, start, end)) >= 0]
    if not found:
        return -1, ""
    at, _, marker = min(found)
    return at, marker


def turn_end(text: str, shape: TemplateShape, start: int, end: int, calls: int) -> tuple[int, str]:
    """Where the turn of a reply whose content ends at `start` ends in text[start:end] (`_first_of` its end
    markers): after its last call, where the template closes every call with the marker a turn of calls ends with
    (gemma-4's `<tool_call|>`), and the reply makes several."""
    at, marker = _first_of(text, shape.end_markers, start, end)
    if marker and marker == shape.call_end_marker and shape.call_end_each:
        for _ in range(calls - 1):
            following = text.find(marker, at + len(marker), end)
            if following < 0:
                break
            at = following
    if marker and marker == shape.call_end_marker and shape.call_end_opens:
        return at, ""  # the next turn's opening: the turn ends before it
    return at, marker


def header_end(template_text: str, shape: TemplateShape, prompt: Prompt | None = None) -> int | None:
    """Where `_reply_start` would find a reply's start inside the template text between the previous message's text
    and the reply, or None where it would search further back (no header is in that text)."""
    if not shape.headers:
        return len(template_text)
    end = max(_last_header_end(template_text, 0, len(template_text), shape.headers), _agreement(template_text, prompt))
    return end if end > 0 else None


def _agreement(template_text: str, prompt: Prompt | None) -> int:
    """How far the template text after a message's text follows `prompt` (what the template writes there to prompt
    the reply, and where its tokens end), in whole tokens: the generated reply begins where it stops following."""
    if prompt is None:
        return 0
    text, ends = prompt
    common = len(os.path.commonprefix([template_text, text]))
    return max((end for end in ends if end <= common), default=0)


def _last_header_end(text: str, start: int, end: int, headers: tuple[str, ...]) -> int:
    """The end of the header in text[start:end] that ends last (the longest where several end together: the
    whole generation prompt before a part of it), or -1."""
    found = -1
    for header in headers:
        at = text.rfind(header, start, end)
        if at >= 0:
            found = max(found, at + len(header))
    return found


def think_block(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The reasoning of a reply whose content opens with a <think> block the template kept as it was."""
    opened = text.find("<think>", start, end)
    if opened < 0 or text[start:opened].strip():
        return None
    closed = text.find("</think>", opened, end)
    if closed < 0:
        raise UnclosedThink
    return opened + len("<think>"), closed


class UnclosedThink(Exception):
    """A reply's think block has no end; `render_chats` names the sample (`unclosed_think`)."""


def _reply_start(text: str, start: int, end: int, shape: TemplateShape, prompt: Prompt | None = None) -> int:
    """Where a reply begins in the template text text[start:end] before it: after its last assistant header, or
    (given the `prompt` the template writes after the previous message's text, which ends at `start`) where that
    text stops following the prompt, whichever is later."""
    found = _last_header_end(text, start, end, shape.headers)
    if agreed := _agreement(text[start:end], prompt):
        found = max(found, start + agreed)
    return found if found >= 0 else end
