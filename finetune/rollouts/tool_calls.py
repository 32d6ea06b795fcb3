"""Tool calls as the model's chat template writes them: how a turn's calls are read back, and the text that answers
them (`ToolTemplate`), both learnt from the template itself by rendering probe calls, as the masks learn where
replies end (`finetune.data.chat.templates`): no template or vendor is named here.

Reading calls, in order of preference:
- `parser`: the tokenizer ships a response parser (its `response_template`, read by `parse_response`);
- `object`: the template writes each call as a JSON object holding the name and the arguments under two keys
  (`{"name": ..., "arguments": {...}}`, or `parameters`), wherever it puts it (tags, a list, a code fence): every
  such object in the turn is a call;
- `named`: the template writes the name after a fixed text and the arguments as a JSON object after another
  (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}`): the texts learnt from two probe calls (the
  common end of what precedes the first and what separates them) or, where a template renders one call a turn, one.
A format is kept only if it reads back other calls than the probe's from the template's own rendering of them
(`learn_calls`). Templates that write each argument on its own (XML-like parameters) are refused, named as such.

The answer to a turn of calls is the template's rendering of the `tool` messages that follow it, from the end of
the model's turn (its end-of-turn marker, the token the model's turn stopped at) through the next generation
prompt: whatever the template writes there (a user turn around the results, a role of its own, the next turn's
opening think block) is what the model reads, as it would at inference.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from finetune.data.chat.templates import SENTINEL, template_shape
from finetune.errors import FinetuneError, first_line

_PROBE_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "description": "The word."}},
    "required": ["word"]}}}  # fmt: skip
_CHECK_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."},
    "days": {"type": "integer", "description": "How many days."}}, "required": ["city", "days"]}}}  # fmt: skip
_PROBES = [("lookup", {"word": "qzvprobe"}), ("lookup", {"word": "qzvprobf"})]
_PAIRED_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "description": "The word."}, "lang": {"type": "string",
    "description": "Its language."}}, "required": ["word", "lang"]}}}  # fmt: skip
_PAIRED = [("lookup", {"word": "qzvprobe", "lang": "qzvprobl"}), ("lookup", {"word": "qzvprobf", "lang": "qzvprobm"})]
_CHECKS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 12})]


@dataclass(frozen=True)
class Call:
    """A call read from a model's turn: its tool's name and arguments (None where they are not a JSON object, and
    `problem` says what they are)."""

    name: str
    arguments: dict[str, Any] | None
    problem: str | None = None


@dataclass(frozen=True)
class CallFormat:
    """How one template's calls are read back (see the module's docstring)."""

    how: str
    """`parser`, `object`, `named` or `parameters`."""
    opener: str = ""
    """What the template writes before each call (`object`: before its JSON object; `named`: before its name)."""
    name_key: str = "name"
    arguments_key: str = "arguments"
    after_name: str = ""
    """`named`: what comes between a call's name and its arguments' JSON object, as a regular expression;
    `parameters`: what follows the name before its first argument."""
    key_open: str = ""
    """`parameters`: what precedes each argument's name; `key_value` between it and its value, `value_close` after
    the value."""
    key_value: str = ""
    value_close: str = ""
    parser: Callable[[str], list[dict[str, Any]]] | None = None

    def read(self, text: str, schemas: list[dict[str, Any]] | None = None) -> tuple[list[Call], int]:
        """The calls in a model's turn, and how many more it began (its opener written) that could not be read.
        `schemas`: the tools offered, whose parameter types give `parameters` calls' values their JSON types."""
        if self.parser is not None:
            calls = [_call_of(call.get("function", call), "name", "arguments") for call in self.parser(text)]
            return [c for c in calls if c is not None], 0
        if self.how == "parameters":
            calls = list(self._parameters(text, _parameter_types(schemas or [])))
        else:
            calls = list(self._objects(text) if self.how == "object" else self._named(text))
        begun = text.count(self.opener) if self.opener.strip() else len(calls)
        return calls, max(0, begun - len(calls))

    def _objects(self, text: str) -> Iterator[Call]:
        for value in _json_values(text):
            yield from _calls_in(value, self.name_key, self.arguments_key)

    def _named(self, text: str) -> Iterator[Call]:
        pattern = re.compile(re.escape(self.opener) + r"([A-Za-z_][\w.\-]*)" + self.after_name, re.DOTALL)
        for match in pattern.finditer(text):
            try:
                arguments, _ = json.JSONDecoder().raw_decode(text, match.end())
            except ValueError:
                yield Call(match.group(1), None, "its arguments are not JSON")
                continue
            yield Call(match.group(1), *_as_arguments(arguments))

    def _parameters(self, text: str, types: dict[tuple[str, str], str]) -> Iterator[Call]:
        pattern = re.compile(re.escape(self.opener) + r"([A-Za-z_][\w.\-]*)" + re.escape(self.after_name))
        for match in pattern.finditer(text):
            arguments: dict[str, Any] = {}
            at = match.end()
            while text.startswith(self.key_open, at):
                key_end = text.find(self.key_value, at + len(self.key_open))
                value_end = text.find(self.value_close, key_end + len(self.key_value)) if key_end >= 0 else -1
                if value_end < 0:
                    break
                key = text[at + len(self.key_open) : key_end]
                value = text[key_end + len(self.key_value) : value_end]
                arguments[key] = _typed(value, types.get((match.group(1), key)))
                at = value_end + len(self.value_close)
            yield Call(match.group(1), arguments)

    def describe(self) -> str:
        """The format in a line, as `finetune check` prints it."""
        if self.how == "parser":
            return "calls read by the tokenizer's response parser (response_template)"
        if self.how == "object":
            keys = f"{json.dumps(self.name_key)}: NAME, {json.dumps(self.arguments_key)}: {{...}}"
            if not self.name_key:
                keys = "NAME: {...}"
            opener = self.opener.strip()
            return f"calls as JSON objects {{{keys}}}" + (f" after {opener!r}" if opener else "")
        if self.how == "parameters":
            return (
                f"calls as {self.opener!r} NAME {self.after_name!r}, then each argument as {self.key_open!r} KEY "
                f"{self.key_value!r} VALUE {self.value_close!r}"
            )
        return f"calls as {self.opener!r} NAME /{self.after_name}/ {{arguments as JSON}}"


def _parameter_types(schemas: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(tool, argument) -> the argument's JSON type, from the tools' schemas."""
    types = {}
    for schema in schemas:
        function = schema.get("function", schema)
        for key, spec in ((function.get("parameters") or {}).get("properties") or {}).items():
            types[function.get("name"), key] = spec.get("type") if isinstance(spec, dict) else None
    return types


def _typed(value: str, kind: str | None) -> Any:
    """An argument written as text, as its schema's type has it (JSON for anything but a string)."""
    if kind in (None, "string"):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _json_values(text: str) -> Iterator[Any]:
    """Every JSON object or list in `text`, left to right, none inside another."""
    decoder, start = json.JSONDecoder(), 0
    while True:
        starts = [i for i in (text.find("{", start), text.find("[", start)) if i >= 0]
        if not starts:
            return
        begin = min(starts)
        try:
            value, start = decoder.raw_decode(text, begin)
        except ValueError:
            start = begin + 1
            continue
        yield value


def _calls_in(value: Any, name_key: str, arguments_key: str) -> Iterator[Call]:
    """The calls a JSON value holds: objects with the name and arguments keys (an empty name key: an object whose one
    key is the name, its value the arguments), itself or nested, in order, none inside another."""
    call = _call_of(value, name_key, arguments_key) if isinstance(value, dict) else None
    if call is not None:
        yield call
        return
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        yield from _calls_in(child, name_key, arguments_key)


def _call_of(value: dict[str, Any], name_key: str, arguments_key: str) -> Call | None:
    if not name_key:  # {NAME: {arguments}}
        if len(value) != 1:
            return None
        ((name, arguments),) = value.items()
        return Call(name, *_as_arguments(arguments)) if isinstance(arguments, dict) else None
    name = value.get(name_key)
    if not isinstance(name, str) or arguments_key not in value:
        return None
    return Call(name, *_as_arguments(value[arguments_key]))


def _as_arguments(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A call's arguments as a dict: an object, or an object serialized as a string (as some templates write)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None, "its arguments are not JSON"
    if not isinstance(value, dict):
        return None, f"its arguments are {type(value).__name__}, not a JSON object"
    return value, None


def probe_calls(calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Calls as a chat message carries them, each with an id of nine letters and digits (Mistral's templates refuse
    others) that its result answers."""
    return [
        {"id": f"call{n:05d}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for n, (name, arguments) in enumerate(calls, start=1)
    ]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[Any], generation: bool = False
) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)
    except Exception:  # a template that refuses the conversation: the caller says what it lacks
        return None


def _rendered_calls(
    tokenizer: PreTrainedTokenizerBase, calls: list[tuple[str, dict[str, Any]]], tool: dict[str, Any]
) -> tuple[str, int] | None:
    """What the model writes for a turn of calls (two, or one where the template renders one a turn), and how many:
    what the template writes after a user's message, less the generation prompt where it begins so."""
    user = SENTINEL.format("user")
    prompt = _render(tokenizer, [{"role": "user", "content": user}], [tool], generation=True) or ""
    header = prompt.split(user, 1)[1] if user in prompt else ""
    for count in (2, 1):
        for as_text in (False, True):  # arguments as an object, or as its JSON text (templates that concatenate)
            written = [(name, json.dumps(arguments) if as_text else arguments) for name, arguments in calls[:count]]
            turn = {"role": "assistant", "content": "", "tool_calls": probe_calls(written)}
            text = _render(tokenizer, [{"role": "user", "content": user}, turn], [tool])
            if text and user in text and all(str(c[1][next(iter(c[1]))]) in text for c in calls[:count]):
                written = text.split(user, 1)[1]
                return written[len(header) :] if header and written.startswith(header) else written, count
    return None


def learn_calls(tokenizer: PreTrainedTokenizerBase) -> CallFormat:
    """How the tokenizer's chat template writes tool calls (see the module's docstring), checked by reading back
    calls of another tool; a template whose calls cannot be read is refused, saying what it writes."""
    if getattr(tokenizer, "response_template", None) is not None:
        parsed = lambda text: tokenizer.parse_response(text, prefix="").get("tool_calls") or []  # noqa: E731
        return CallFormat("parser", parser=parsed)
    probe = _rendered_calls(tokenizer, _PROBES, _PROBE_TOOL)
    if probe is None:
        call = {"role": "assistant", "content": "", "tool_calls": probe_calls(_PROBES[:1])}
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "q"}, call], tools=[_PROBE_TOOL])
        except Exception as exc:  # the template's own error, which says what it lacks
            raise FinetuneError(
                f"rl.tools: the chat template cannot render a turn of tool calls ({type(exc).__name__}: "
                f"{first_line(exc)}); set data.chat_template to a template that renders tool calls"
            ) from None
        raise FinetuneError(
            "rl.tools: the chat template writes no tool calls (an assistant message's tool_calls rendered with its "
            "tools leave no trace); set data.chat_template to a template that renders tool calls"
        )
    text, count = probe
    markers = tuple(t for t in {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()} if t.strip())
    found = _as_object(text, count, markers) or _as_named(text, count, markers)
    paired = _rendered_calls(tokenizer, _PAIRED, _PAIRED_TOOL) if found is None else None
    if paired is not None:
        found = _as_parameters(*paired, markers)
    check = _rendered_calls(tokenizer, _CHECKS, _CHECK_TOOL)
    if found is not None and check is not None:
        calls, _ = found.read(check[0], [_CHECK_TOOL])
        expected = [Call(name, arguments) for name, arguments in _CHECKS[: check[1]]]
        if calls == expected:
            return found
    raise FinetuneError(
        f"rl.tools: the chat template's tool calls cannot be read back: it writes a turn of calls as {text[:200]!r}, "
        "neither JSON objects holding a name and arguments nor a name followed by a JSON object of arguments (each "
        "argument written apart is not read); give the tokenizer a response_template (transformers' parse_response) "
        "or set data.chat_template to a template that writes calls as JSON"
    )


def _as_object(text: str, count: int, markers: tuple[str, ...]) -> CallFormat | None:
    """The `object` format, if the probe calls are JSON objects holding their name and arguments."""
    placed = []
    for name, arguments in _PROBES[:count]:
        found = next(
            ((keys, start, end) for value, start, end in _located_values(text)
             if (keys := _keys_of(value, name, arguments)) is not None and start >= (placed[-1][2] if placed else 0)),
            None,
        )  # fmt: skip
        if found is None:
            return None
        placed.append(found)
    openers = [text[: placed[0][1]]] + ([text[placed[0][2] : placed[1][1]]] if count == 2 else [])
    return CallFormat("object", _opener(openers, markers), *placed[0][0])


def _located_values(text: str) -> Iterator[tuple[Any, int, int]]:
    """Every JSON value decodable from each `{` or `[` of `text` (nested ones too), with where it starts and ends."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[{\[]", text):
        try:
            value, end = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        yield value, match.start(), end


def _keys_of(value: Any, name: str, arguments: dict[str, Any]) -> tuple[str, str] | None:
    """The keys of an object holding `name` and `arguments` (as an object or its JSON text); ("", "") for an object
    whose one key is the name."""
    if not isinstance(value, dict):
        return None
    if value == {name: arguments}:
        return "", ""
    name_keys = [k for k, v in value.items() if v == name]
    argument_keys = [k for k, v in value.items() if _as_arguments(v)[0] == arguments]
    return (name_keys[0], argument_keys[0]) if name_keys and argument_keys else None


def _as_named(text: str, count: int, markers: tuple[str, ...]) -> CallFormat | None:
    """The `named` format, if each probe call is its name after a fixed text, then its arguments' JSON object."""
    name = _PROBES[0][0]
    places = []
    search = 0
    for _, arguments in _PROBES[:count]:
        at = text.find(name, search)
        value = text.find(arguments["word"], at)
        opening = text.rfind("{", at, value)
        if at < 0 or opening < 0:
            return None
        try:
            decoded, end = json.JSONDecoder().raw_decode(text, opening)
        except ValueError:
            return None
        if decoded != arguments:
            return None
        places.append((at, opening, end))
        search = end
    afters = [text[at + len(name) : opening] for at, opening, _ in places]
    # Where the texts after the names differ (a call's number or id written there), what lies between their common
    # beginning and end is any text.
    after = re.escape(afters[0])
    if len(set(afters)) > 1:  # kept to the markers around the part that differs (an id's common digits are not)
        head = os.path.commonprefix(afters)
        tail = os.path.commonprefix([a[len(head) :][::-1] for a in afters])[::-1]
        head = head[: max((head.rfind(m) + len(m) for m in markers if m in head), default=0)]
        tail = tail[min((tail.find(m) for m in markers if m in tail), default=len(tail)) :]
        after = re.escape(head) + ".*?" + re.escape(tail)
    openers = [text[: places[0][0]]] + ([text[places[0][2] : places[1][0]]] if count == 2 else [])
    return CallFormat("named", _opener(openers, markers), after_name=after)


def _as_parameters(text: str, count: int, markers: tuple[str, ...]) -> CallFormat | None:
    """The `parameters` format, if each probe call is its name after a fixed text, then each argument its key and
    value between fixed texts (two arguments a call tell the texts apart)."""
    name, calls, search = _PAIRED[0][0], [], 0
    for _, arguments in _PAIRED[:count]:
        at = text.find(name, search)
        if at < 0:
            return None
        places = []
        for key, value in arguments.items():
            key_at = text.find(key, at)
            value_at = text.find(value, key_at)
            if key_at < 0 or value_at < 0:
                return None
            places.append((key_at, key_at + len(key), value_at, value_at + len(value)))
        places.sort()
        calls.append((at, places))
        search = places[-1][3]
    at, ((_, key_end, value_at, value_end), (second_key, _, _, last_end)) = calls[0]
    after_name, gap = text[at + len(name) : calls[0][1][0][0]], text[value_end:second_key]
    key_open = os.path.commonprefix([after_name[::-1], gap[::-1]])[::-1]
    value_close = gap[: len(gap) - len(key_open)]
    if not key_open or not value_close or not text.startswith(value_close, last_end):
        return None
    openers = [text[:at]] + ([text[last_end : calls[1][0]]] if count == 2 else [])
    return CallFormat(
        "parameters", _opener(openers, markers), after_name=after_name[: len(after_name) - len(key_open)],
        key_open=key_open, key_value=text[key_end:value_at], value_close=value_close,
    )  # fmt: skip


def _opener(texts: list[str], markers: tuple[str, ...]) -> str:
    """What precedes every call: the common end of the texts before each (with one call, its text from the last
    line break or marker on), from its first whole marker where it begins inside one, without leading white space."""
    if len(texts) > 1:
        common = os.path.commonprefix([t[::-1] for t in texts])[::-1]
    else:
        text = texts[0]
        cut = max(text.rfind("\n", 0, len(text.rstrip())), text.rfind(">", 0, len(text.rstrip()) - 1))
        common = text[cut + 1 :]
    partial = [len(m) - k for m in markers for k in range(1, len(m)) if common.startswith(m[k:]) and m[k:] != common]
    return common[max(partial, default=0) :].lstrip()


@dataclass(frozen=True)
class ToolTemplate:
    """A chat template's tool calls and their answers, learnt once per run (`tool_template`)."""

    tokenizer: PreTrainedTokenizerBase
    calls: CallFormat
    ends: tuple[str, ...]
    """What may end the model's turn of calls in the template's text (its end-of-turn markers)."""

    def results_text(self, calls: list[Call], results: list[str], tools: list[dict[str, Any]]) -> str:
        """The text that answers a turn of `calls` with `results` (one each, in order): the template's rendering of
        the tool messages from the end of the model's turn through the next generation prompt."""
        named = [(call.name, call.arguments if call.arguments is not None else {}) for call in calls]
        marked = [SENTINEL.format(f"result{n}") for n in range(len(results))]
        probe, actual = (self._rendered(named, texts, tools) for texts in (marked, results))
        begin = probe.find(marked[0]) if marked else len(probe)
        cut = max((probe.rfind(end, 0, begin) + len(end) for end in self.ends if probe.rfind(end, 0, begin) >= 0),
                  default=-1)  # fmt: skip
        if cut < 0 or actual[:cut] != probe[:cut]:
            raise FinetuneError(
                "rl.tools: the chat template writes no end of the model's turn before tool results "
                f"(none of {', '.join(map(repr, self.ends))} before them); set data.chat_template to one that does"
            )
        return actual[cut:]

    def _rendered(self, calls: list[tuple[str, dict[str, Any]]], results: list[str], tools: list[Any]) -> str:
        messages = probe_calls(calls)
        answers = [
            {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": result}
            for call, result in zip(messages, results, strict=True)
        ]
        conversation = [
            {"role": "user", "content": SENTINEL.format("user")},
            {"role": "assistant", "content": "", "tool_calls": messages},
            *answers,
        ]
        text = _render(self.tokenizer, conversation, tools, generation=True)
        if text is None:
            raise FinetuneError(
                "rl.tools: the chat template cannot render tool results (a tool message after a turn of calls); "
                "set data.chat_template to a template that renders the `tool` role"
            )
        return text

    def history_difference(self) -> str | None:
        """Where the template renders a finished turn otherwise than the model read and wrote it while acting (the
        generation prompt writes what the history drops, or the history writes what the model never saw), in a
        phrase; None where every turn's rendering is the prefix of the next."""
        user = {"role": "user", "content": SENTINEL.format("user")}
        call = {"role": "assistant", "content": "", "tool_calls": probe_calls([_PROBES[0]])}
        result = {"role": "tool", "tool_call_id": "call00001", "name": "lookup", "content": "RESULT"}
        answer = {"role": "assistant", "content": "ANSWER"}
        steps = [([user], [user, call]), ([user, call, result], [user, call, result, answer])]
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        for acting, finished in steps:
            # Compared as tokens: a text that is the history's prefix may still be cut into other tokens there.
            read = encode(_render(self.tokenizer, acting, [_PROBE_TOOL], generation=True) or "")
            history = encode(_render(self.tokenizer, finished, [_PROBE_TOOL]) or "")
            if history[: len(read)] != read:
                at = len(os.path.commonprefix([read, history]))
                seen, written = (self.tokenizer.decode(ids[at : at + 8]) for ids in (read, history))
                return f"the model reads {seen!r} where the history writes {written!r}"
        return None

    def describe(self) -> str:
        """What `finetune check` prints: the call format, and the text answering a probe call."""
        text = self.results_text([Call(*_PROBES[0])], ["RESULT"], [_PROBE_TOOL])
        return f"tool calls: {self.calls.describe()}; a result reads {text!r}"


def tool_template(tokenizer: PreTrainedTokenizerBase) -> ToolTemplate:
    """The tokenizer's chat template's tool calls and results, learnt and checked (refused naming what it lacks)."""
    calls = learn_calls(tokenizer)
    shape = template_shape(tokenizer)
    ends = tuple(e for e in dict.fromkeys([*shape.end_markers, shape.last_end_marker]) if e)
    template = ToolTemplate(tokenizer, calls, ends)
    template.results_text([Call(*_PROBES[0])], ["RESULT"], [_PROBE_TOOL])  # refused here, before anything loads
    return template
