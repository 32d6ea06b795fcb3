"""Conversations checked and rendered by the chat template: a batch in as few `apply_chat_template` calls as its
tools allow, one conversation again (with placeholders, for generation, per turn) where locating needs it."""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from finetune.data.chat.messages import (
    TOOL_RESPONSE,
    chat_messages,
    chat_tools,
    check_rendered_fields,
    reasoning_apart,
    reasoning_for,
    roles_and_texts,
    split_weights,
    unwrapped_tool_result,
    with_text_arguments,
)
from finetune.data.chat.spans import Prompt
from finetune.data.chat.templates import arguments_as_text, reasoning_field
from finetune.errors import FinetuneError, first_line


@dataclass(slots=True)
class ChatBatch:
    """A batch of conversations checked and normalized (`check_batch`), as columns."""

    tokenizer: PreTrainedTokenizerBase
    messages: list[list[dict[str, Any]]]
    tools: list[list[dict[str, Any]] | None]
    indices: list[int]
    roles: list[tuple[str, ...] | None]
    """The roles of each conversation that is only roles and texts, without tools (`roles_and_texts`); else None."""
    contents: list[list[str] | None]
    """The texts of those conversations, in message order: with the roles, all that a skeleton needs of them."""
    untrained: list[frozenset[int]]
    """The positions of each conversation's replies marked `"weight": 0` (OpenAI's chat format): context only."""

    def chat(self, n: int) -> Chat:
        """Conversation n, as the renderings that take it one at a time need it."""
        return Chat(self.tokenizer, self.messages[n], self.tools[n], self.indices[n])


def check_batch(
    conversations: list[Any], tools: list[Any], indices: list[int], tokenizer: PreTrainedTokenizerBase
) -> ChatBatch:
    """Each conversation checked and normalized (`chat_messages`), with its tools parsed."""
    template = tokenizer.chat_template or ""
    field = reasoning_field(tokenizer)
    calls_as_text = "tool_calls" in template and arguments_as_text(tokenizer)
    wraps_tool_results = TOOL_RESPONSE[0] in template
    checked, parsed, roles, contents, untrained = [], [], [], [], []
    for messages, schemas, index in zip(conversations, tools, indices, strict=True):
        plain = roles_and_texts(messages)
        skipped: frozenset[int] = frozenset()
        if plain is None:
            messages = chat_messages(messages, index)
            if calls_as_text:
                messages = [with_text_arguments(message) for message in messages]
            if wraps_tool_results:
                messages = [unwrapped_tool_result(message) for message in messages]
            messages, skipped = split_weights(messages, index)
            check_rendered_fields(messages, template, index)
            messages = [reasoning_for(message, field, f"sample {index}, message {n}") for n, message in
                        enumerate(messages)]  # fmt: skip
        if field is not None:
            apart = [reasoning_apart(message, field, index) for message in messages]
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
    return ChatBatch(tokenizer, checked, parsed, indices, roles, contents, untrained)


def reply_positions(messages: list[dict[str, Any]]) -> tuple[int, ...]:
    """The positions of the assistant messages."""
    return tuple(i for i, message in enumerate(messages) if message["role"] == "assistant")


def render_all(batch: ChatBatch) -> list[str]:
    """Each conversation's text, rendered in one `apply_chat_template` call per set of tools (the
    per-call work of transformers is then paid once per batch, as a batched `datasets.map` pays it);
    a refused batch is rendered again one conversation at a time, to name the sample the template refuses."""
    if not batch.messages:
        return []
    texts = render_batches(batch.messages, batch.tools, batch.tokenizer)
    if None in texts:
        return [text if text is not None else batch.chat(n).render() for n, text in enumerate(texts)]
    return texts


def render_batches(
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
    except Exception:  # the caller renders it again through Chat.render, which names the sample
        return None


@dataclass(slots=True)
class Chat:
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

    def prompt_before(self, i: int) -> Prompt | None:
        """What the template writes after message i - 1's text to prompt reply i (`finetune.data.chat.spans.Prompt`),
        where message i - 1 is a user's, system's or tool's with text; else None."""
        return prompt_after(self.tokenizer, self.messages[:i], self.tools)

    def up_to(self, i: int) -> Chat:
        return dataclasses.replace(self, messages=self.messages[: i + 1])


def prompt_after(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> Prompt | None:
    """What the template writes after the last message's text when a reply is to follow (`Prompt`), or None where
    that message is an assistant's, has no text, or the template refuses the conversation."""
    if not messages or messages[-1]["role"] == "assistant":
        return None
    previous = messages[-1].get("content")
    previous = previous.strip() if isinstance(previous, str) else ""
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception:  # the template refuses this prefix of a conversation it renders whole: no anchor
        return None
    at = prompt.rfind(previous) if previous else -1
    if at < 0:
        return None
    tail = prompt[at + len(previous) :]
    if not tail:
        return None
    ends = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return tail, tuple(end for _, end in ends)
