"""`render_chats`: each conversation rendered and its assistant replies located (from the skeleton, else by
rendering it with placeholders for its replies, else one sample per reply); `probe_template` for `finetune check`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from finetune.data.chat.messages import reasoning_of, unclosed_think
from finetune.data.chat.rendering import Chat, check_batch, render_all, reply_positions
from finetune.data.chat.skeleton import filled_spans, skeletons_of, with_placeholder
from finetune.data.chat.spans import Around, Regions, UnclosedThink, spans_of
from finetune.data.chat.templates import PROBE_CALL, PROBE_TOOL, SENTINEL, TemplateShape, template_shape
from finetune.errors import FinetuneError

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
    batch = check_batch(conversations, tools if tools is not None else [None] * len(conversations), indices, tokenizer)
    texts = render_all(batch)
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
    for n, (text, (skeleton, values)) in enumerate(zip(texts, skeletons_of(batch, shape), strict=True)):
        replies = skeleton.replies if skeleton is not None else reply_positions(batch.messages[n])
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
            located = filled_spans(skeleton, values, trained, text) if skeleton is not None else None
            located = located or _reply_spans(batch.chat(n), shape, trained, text)
        except UnclosedThink:
            raise unclosed_think(indices[n]) from None
        if located is None:
            _refuse_dropped_call_text(batch.chat(n), trained, text)
            if multi_turn != "per_turn":
                raise FinetuneError(
                    f"sample {indices[n]}: the chat template renders this conversation so that its assistant "
                    "replies cannot be located in it; set data.multi_turn=per_turn (one sample per reply, each "
                    "prompt as rendered for generation) or data.multi_turn=last (its last reply only)"
                )
            try:
                per_turn[n] = _per_turn(batch.chat(n), shape, list(trained))
            except UnclosedThink:
                raise unclosed_think(indices[n]) from None
            located = [], []
        spans.append(located[0])
        reasoning.append(located[1])
    rendered = RenderedChats(texts, spans, reasoning, [False] * len(texts))
    return _expanded(rendered, per_turn) if per_turn else rendered


def _refuse_dropped_call_text(chat: Chat, trained: tuple[int, ...] | list[int], text: str) -> None:
    """Refuse a conversation whose template writes nothing of a trained turn's text beside its tool calls (its words,
    or reasoning given in the content as a think block): rendered without that text, the conversation is the same.
    Such a turn cannot be located, and saying why is more use than saying that."""
    for i in trained:
        message = chat.messages[i]
        if not (message.get("tool_calls") and message.get("content")):
            continue
        without = [*chat.messages[:i], {**message, "content": ""}, *chat.messages[i + 1 :]]
        try:
            dropped = chat.render(without) == text
        except FinetuneError:  # the template refuses a turn of calls alone: then it writes the text it was given
            continue
        if dropped:
            raise _dropped_call_text(chat.index, i)


def _dropped_call_text(sample: int, message: int) -> FinetuneError:
    return FinetuneError(
        f"sample {sample}, message {message}: the chat template writes no text for an assistant turn that makes tool "
        "calls, so this turn's text (its reasoning or words before the calls) would be neither seen nor trained; move "
        "that text to a turn of its own or remove it, or set data.chat_template to a template that renders it"
    )


def _expanded(rendered: RenderedChats, per_turn: dict[int, list[RenderedChat]]) -> RenderedChats:
    """The samples, with those of the conversations in `per_turn` replaced by their per-turn samples."""
    samples = []
    for n in range(len(rendered)):
        samples.extend(per_turn[n] if n in per_turn else [rendered[n]])
    return RenderedChats.of(samples)


def _per_turn(chat: Chat, shape: TemplateShape, replies: list[int]) -> list[RenderedChat]:
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


# The shapes agent and reasoning data take: several turns, reasoning on the last; a call with reasoning beside it (a
# template that writes no text for a turn of calls would drop it); a turn of parallel calls, their results, an answer.
_PROBES = {
    "multi-turn replies with reasoning": [
        {"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"},
        {"role": "assistant", "content": "Second answer.", "reasoning_content": "Some thought."},
    ],
    "a tool call with reasoning beside it, its result and an answer": [
        {"role": "user", "content": "Look a word up."},
        {"role": "assistant", "reasoning_content": "A lookup answers it.", "tool_calls": [PROBE_CALL]},
        {"role": "tool", "content": "one result"}, {"role": "assistant", "content": "Found."},
    ],
    "parallel tool calls, their results and an answer": [
        {"role": "user", "content": "Look two words up."},
        {"role": "assistant", "tool_calls": [PROBE_CALL, PROBE_CALL]},
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
        schemas = [[PROBE_TOOL]] if calls and "tools" in tokenizer.chat_template else None
        try:
            render_chats([conversation], tokenizer, True, tools=schemas)
        except FinetuneError as exc:
            problems.append(f"{shape} ({str(exc).replace('sample 0', 'its probe', 1)})")
        else:
            located.append(shape)
    parts = [f"replies located exactly in {', in '.join(located)}"] if located else []
    parts += [f"cannot train {problem}" for problem in problems]
    return "chat template: " + "; ".join(parts)


def _reply_spans(
    chat: Chat, shape: TemplateShape, trained: list[int], text: str
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """Character spans in `text` of the replies `trained` (message positions), and of the reasoning
    inside them, or None when the template's rendering does not let them be located (see `render_chats`)."""
    placeholders = list(chat.messages)
    names = {}  # reply -> the call name its placeholder stands for (a reply of tool calls only)
    calls = {}  # reply -> the name of the first call of a reply with text and calls, and the placeholder in its place
    for k, i in enumerate(trained):
        replaced = with_placeholder(chat.messages[i], SENTINEL.format(k))
        if replaced is None:
            return None
        message = replaced[0]
        if not chat.messages[i].get("content"):
            names[k] = replaced[1]
        elif message.get("tool_calls") and (named := with_placeholder({"tool_calls": message["tool_calls"]},
                                                                       SENTINEL.format(f"n{k}"))):  # fmt: skip
            message = {**message, "tool_calls": named[0]["tool_calls"]}
            calls[k] = named[1], SENTINEL.format(f"n{k}")
        if (field := reasoning_of(message)) is not None:
            message = {**message, field: SENTINEL.format(f"r{k}")}
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
        # The first place stays a placeholder (where the turn's calls are: `spans_of`); later ones are template text.
        first = marked.find(placeholder) + len(placeholder)
        marked = marked[:first] + marked[first:].replace(placeholder, name)
    for k, name in names.items():
        # Templates that name the call again in its result's header (harmony's `functions.get_weather to=...`,
        # gemma-4's): the first place is the call's; the later ones are template text, the name as written.
        placeholder = SENTINEL.format(k)
        first = marked.find(placeholder) + len(placeholder)
        if first >= len(placeholder):
            marked = marked[:first] + marked[first:].replace(placeholder, name)
    # The placeholders in the order the template wrote them: every reply once, its reasoning once or
    # not at all (templates drop the reasoning of earlier replies).
    found = []
    for k, i in enumerate(trained):
        kinds = [("reasoning", SENTINEL.format(f"r{k}")), ("reply", SENTINEL.format(k))]
        for kind, placeholder in kinds + ([("call", calls[k][1])] if k in calls else []):
            count = marked.count(placeholder)
            if kind == "reply" and count == 0 and chat.messages[i].get("tool_calls") and k not in names:
                raise _dropped_call_text(chat.index, i)
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
    regions: Regions = {}
    position, end_of_text = len(segments[0]), len(text) - len(segments[-1])
    for j, (_, kind, k, _) in enumerate(found):
        following = segments[j + 1]
        end = end_of_text if j == len(found) - 1 else text.find(following, position)
        if end < position or end > end_of_text:
            return None
        regions[kind, k] = (position, end, j)
        position = end + len(following)
    # The calls' places, apart: the regions that bound each other are the replies' words and reasoning.
    calls_at = {k: (start, end) for (kind, k), (start, end, _) in regions.items() if kind == "call"}
    kept = sorted((j, key, start, end) for key, (start, end, j) in regions.items() if key[0] != "call")
    regions = {key: (start, end, j) for j, (_, key, start, end) in enumerate(kept)}
    return spans_of(text, regions, shape, _around(chat, trained, regions, calls_at, text))


def _around(
    chat: Chat, trained: list[int], regions: Regions, calls_at: dict[int, tuple[int, int]], text: str
) -> list[Around]:
    """What lies around each trained reply in `text`: where the texts of the messages before and after it end and
    begin (found after the previous reply, and after this one), the template's prompt for it, its calls."""
    around, previous = [], 0
    for k, i in enumerate(trained):
        first = min(start for (_, reply), (start, _, _) in regions.items() if reply == k)
        last = max(end for (_, reply), (_, end, _) in regions.items() if reply == k)
        before, after = _text_of(chat.messages, i - 1), _text_of(chat.messages, i + 1)
        floor = text.rfind(before, previous, first) if before else -1
        ceiling = text.find(after, last) if after else -1
        around.append(Around(
            floor + len(before) if floor >= 0 else 0, ceiling if ceiling >= 0 else len(text), chat.prompt_before(i),
            len(chat.messages[i].get("tool_calls") or []), calls_at.get(k),
        ))  # fmt: skip
        previous = regions["reply", k][1]
    return around


def _text_of(messages: list[dict[str, Any]], i: int) -> str:
    """Message i's text as a template writes it (stripped), where it is a user's, system's or tool's; else ""."""
    if not 0 <= i < len(messages) or messages[i]["role"] == "assistant":
        return ""
    content = messages[i].get("content")
    return content.strip() if isinstance(content, str) else ""
