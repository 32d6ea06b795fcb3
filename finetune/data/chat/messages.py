"""Conversations checked and normalized before any rendering: roles and content (text parts, ShareGPT turns),
tool calls and their schemas, reasoning in the field a template reads, replies marked `weight: 0`."""

from __future__ import annotations

import json
from typing import Any

from finetune.errors import FinetuneError

TOOL_RESPONSE = ("<tool_response>", "</tool_response>")


def unwrapped_tool_result(message: dict[str, Any]) -> dict[str, Any]:
    """A tool result that the data wraps in the `<tool_response>` tags the template writes around every tool
    result itself (Hermes function-calling data on Qwen's and Hermes' templates) without them: the model sees
    one wrapper, as at inference, not two."""
    content = message.get("content")
    if message.get("role") != "tool" or not isinstance(content, str):
        return message
    opening, closing = TOOL_RESPONSE
    inner = content.strip()
    if not (inner.startswith(opening) and inner.endswith(closing)):
        return message
    return {**message, "content": inner[len(opening) : -len(closing)].strip("\n")}


def split_weights(messages: list[dict[str, Any]], index: int) -> tuple[list[dict[str, Any]], frozenset[int]]:
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


def check_rendered_fields(messages: list[dict[str, Any]], template: str, index: int) -> None:
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


def reasoning_for(message: dict[str, Any], field: str | None, where: str) -> dict[str, Any]:
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


def reasoning_apart(message: dict[str, Any], field: str, index: int = -1) -> dict[str, Any]:
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


def roles_and_texts(messages: Any) -> tuple[tuple[str, ...], list[str]] | None:
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


def with_text_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its tool calls' arguments as JSON text, for a template that writes them as it is given them
    (`finetune.data.chat.templates.arguments_as_text`)."""
    if not isinstance(message.get("tool_calls"), list):
        return message
    calls = []
    for call in message["tool_calls"]:
        holder = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
        if isinstance(holder, dict) and isinstance(holder.get("arguments"), dict):
            holder = {**holder, "arguments": json.dumps(holder["arguments"], ensure_ascii=False)}
            call = {**call, "function": holder} if isinstance(call.get("function"), dict) else holder
        calls.append(call)
    return {**message, "tool_calls": calls}


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


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The field holding a message's reasoning as text (checked messages have at most one), or None."""
    for field in REASONING_FIELDS:
        reasoning = message.get(field)
        if isinstance(reasoning, str) and reasoning.strip():
            return field
    return None


def unclosed_think(index: int) -> FinetuneError:
    return FinetuneError(
        f"sample {index}: a reply opens <think> and never closes it (a trace cut off by a generation limit?), so "
        "its reasoning and its answer cannot be told apart; close the block with </think> or remove the sample"
    )
