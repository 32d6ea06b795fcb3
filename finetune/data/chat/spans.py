"""Where a reply lies in a rendered text: from the end of its assistant header through its end-of-turn marker,
with the reasoning inside it."""

from __future__ import annotations

from finetune.data.chat.templates import TemplateShape

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


def _reply_start(text: str, start: int, end: int, shape: TemplateShape) -> int:
    """Where a reply begins in the template text text[start:end] before it: after its last assistant header."""
    found = _last_header_end(text, start, end, shape.headers)
    return found if found >= 0 else end
