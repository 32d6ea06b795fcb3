"""Chat templates: a recipe's read and checked, and what a template writes around replies (its shape: headers,
end-of-turn markers), learned once per template by rendering probe conversations."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import GenerationConfig, PreTrainedTokenizerBase

from finetune.data.chat.messages import REASONING_FIELDS
from finetune.errors import FinetuneError, first_line


def reasoning_field(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The field the tokenizer's chat template writes a reply's reasoning from, or None if it writes none."""
    return _reasoning_field(_Renderer(tokenizer)) if tokenizer.chat_template else None


@functools.lru_cache(maxsize=8)
def _reasoning_field(render: _Renderer) -> str | None:
    # Rendered, not searched for: a template may name `thinking` for something else (Qwen3's `enable_thinking`).
    probe = SENTINEL.format("probe")
    for field in REASONING_FIELDS:
        text = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", field: probe}])
        if text is not None and probe in text:
            return field
    return None


def arguments_as_text(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template writes a tool call's arguments as the text it is given (it concatenates
    them, as DeepSeek-V3's does), rather than serializing an object (`tojson`, or its own layout): decided by
    rendering a probe call both ways, never by the template's name."""
    return bool(tokenizer.chat_template) and _arguments_as_text(_Renderer(tokenizer))


@functools.lru_cache(maxsize=8)
def _arguments_as_text(render: _Renderer) -> bool:
    def rendered(arguments: Any) -> str | None:
        call = {**PROBE_CALL, "function": {**PROBE_CALL["function"], "arguments": arguments}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        return render(messages, tools=[PROBE_TOOL])

    as_object = rendered({"word": _PROBE_VALUE})
    as_text = rendered(json.dumps({"word": _PROBE_VALUE}))
    if as_text is None or _PROBE_VALUE not in as_text:
        return False
    # Refused, or written as Python's repr of a dict (`{'word': ...}`: concatenated, not serialized).
    return as_object is None or f"'word': '{_PROBE_VALUE}'" in as_object


# Every field a schema may have (a template may read a parameter's description: Command-R+'s does).
PROBE_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "description": "The word."}},
    "required": ["word"]}}}  # fmt: skip


_PROBE_VALUE = "qzvprobe"
"""A tool call's argument in the probes: plain ASCII, which JSON writes as it is."""
PROBE_CALL = {"id": "qzv123456", "type": "function", "function": {"name": "lookup", "arguments": {
    "word": _PROBE_VALUE}}}  # fmt: skip
"""A probe call with an id (nine characters: Mistral's templates refuse others) that a tool's result can answer."""


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
    probe = [{"role": role, "content": SENTINEL.format(role)} for role in ("system", "user", "assistant")]
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
    call_end_marker: str = ""
    """The marker a turn of tool calls ends with, where it is not `end_marker` (harmony's `<|call|>`, gemma-4's
    `<tool_call|>`, GLM's `<|observation|>`: its turns end where the next opens)."""
    call_end_each: bool = False
    """`call_end_marker` closes each call (gemma-4's), not the turn: a turn of several ends after its last."""
    turn_opener: str = ""
    """The marker the generation prompt opens with (`<|im_start|>`): where a turn begins."""
    call_end_opens: bool = False
    """`call_end_marker` opens the next turn (the template closes no turn of calls): the turn ends before it."""
    headers: tuple[str, ...] = ()
    """What may open an assistant turn, the longest first: the reply prefix and the generation prompt, and the
    generation prompt cut short at its token boundaries (`_opening_headers`). A prompt that opens the reasoning
    (QwQ's, DeepSeek-R1's `<think>\n`) or closes it (non-thinking modes' `</think>`) is written so for the reply
    being generated only: an earlier turn, or a turn of tool calls, opens without it, and all it writes after the
    rest of the header (its calls' wrappers, an empty think block) is what the model generated in that turn."""

    @property
    def end_markers(self) -> tuple[str, ...]:
        """What may end a reply: the first of these after its content."""
        return tuple(marker for marker in dict.fromkeys([self.end_marker, self.call_end_marker]) if marker)


SENTINEL = "\ue000{}\ue001"  # private-use characters: in no template, untouched by trim


def template_shape(tokenizer: PreTrainedTokenizerBase) -> TemplateShape:
    """The reply prefix, generation prompt and end marker of the tokenizer's template (cached per template)."""
    # Markers: special and added tokens, less those of white space alone (gemma's "\n" tokens format, not mark).
    added = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    specials = tuple(sorted((token for token in added if token.strip()), key=len))
    return _template_shape(tokenizer.chat_template, specials, _stop_texts(tokenizer), _Renderer(tokenizer))


def _stop_texts(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Where the model ends its own turn: the tokenizer's end-of-sequence token and, where the tokenizer's folder
    has one, the generation config's (a chat model's end-of-turn tokens, where they differ)."""
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if (folder / "generation_config.json").is_file():
        try:
            configured = GenerationConfig.from_pretrained(folder).eos_token_id
        except (OSError, ValueError):  # a damaged file: the tokenizer's own token still says where a turn ends
            configured = None
        ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
        stops += [token for token in tokenizer.convert_ids_to_tokens(ids) if token]
    return tuple(dict.fromkeys(stops))


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
def _template_shape(
    template: str, specials: tuple[str, ...], stops: tuple[str, ...], render: _Renderer
) -> TemplateShape:
    user, reply, user2 = (SENTINEL.format(f"probe{i}") for i in range(3))
    # Probed without tools, or with one where the template renders nothing without (Hermes-3's and Command-R's
    # tool-use templates raise): its layout is learned either way, never left empty.
    tools = None
    if render([{"role": "user", "content": user}], generation=True) is None:
        tools = [PROBE_TOOL] if render([{"role": "user", "content": user}], True, [PROBE_TOOL]) else None
    tokenizer, render = render.tokenizer, functools.partial(render, tools=tools)
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
    # How the template opens other turns: what it writes before a user message (first, after a system message,
    # after a reply): a generation prompt's cut must say more than any of it.
    openings = [bare.split(user, 1)[0], after_reply]
    openings.append(_between(render, {"role": "system", "content": user2}, {"role": "user", "content": user}))
    headers = _opening_headers(reply_prefix, generation_prompt, openings, tokenizer)
    # The end of a turn: the model's own, where the template writes an end-of-sequence token after a reply (through
    # the first: Command-R's `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`, not the next turn's header it writes on).
    # Else what the template writes after a reply both before the next turn and at the end of the conversation,
    # through its last marker; where those differ from the first character, through the first marker after it.
    end_marker = _through_first_special(after_reply, stops)
    if end_marker:
        last_end_marker = _through_first_special(after_last, stops) or _through_first_special(after_last, specials)
    else:
        shared = _through_last_special(os.path.commonprefix([after_reply, after_last]), specials)
        end_marker = shared or _through_first_special(after_reply, specials)
        last_end_marker = _through_first_special(after_last, specials)
    # Whether a user's turn closes with a marker of its own before the reply's header (ChatML's `<|im_end|>`), or
    # ends where the next turn opens (GLM's: `<|assistant|>` ends it, as `<|user|>` ends a reply).
    user_closing = reply_prefix[: len(reply_prefix) - len(generation_prompt)]
    closed = bool(_through_last_special(user_closing, specials))
    call_end = _call_end_marker(render, end_marker, stops, specials, closed)
    return TemplateShape(
        reply_prefix, generation_prompt, end_marker, last_end_marker, headers=headers, call_end_marker=call_end,
        call_end_each=bool(call_end) and _closes_each_call(render, call_end),
        call_end_opens=_opens_a_turn(call_end, generation_prompt),
        turn_opener=_last_marker(_through_first_special(generation_prompt.lstrip(), specials), specials),
    )  # fmt: skip


def _closes_each_call(render: Callable[..., str | None], marker: str) -> bool:
    """Whether the template writes `marker` after each of a turn's calls (two probe calls: twice after the first)."""
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL] * 2},
    ]
    text = render(turns, tools=[PROBE_TOOL]) or ""
    return _PROBE_VALUE in text and text.split(_PROBE_VALUE, 1)[1].count(marker) >= 2


def _call_end_marker(
    render: Callable[..., str | None],
    end_marker: str,
    stops: tuple[str, ...],
    specials: tuple[str, ...],
    closed: bool,
) -> str:
    """Where a turn of tool calls ends, learned from a probe call (as the conversation's last turn, and answered by
    a tool's result), where that is not `end_marker`: the model's own end of turn (an end-of-sequence token the
    template writes after the call); for a template whose turns end where the next opens (GLM's: `<|user|>` ends a
    reply, `<|observation|>` a turn of calls), the tool result's opening; else the first marker after the call's
    arguments that the call does not also write inside itself (gemma-4's string quotes `<|"|>` are the call's;
    its `<tool_call|>` ends it)."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}]
    result = SENTINEL.format("result")
    answer = {"role": "tool", "content": result, "tool_call_id": PROBE_CALL["id"], "name": "lookup"}
    answered = render([*turns, answer], tools=[PROBE_TOOL]) or ""
    alone = render(turns, tools=[PROBE_TOOL]) or ""
    if _PROBE_VALUE not in answered or result not in answered or _PROBE_VALUE not in alone:
        return ""  # a template that writes no calls, or no probe's: replies end at `end_marker`
    before_result = answered.rsplit(_PROBE_VALUE, 1)[1].split(result, 1)[0]
    closing = alone.rsplit(_PROBE_VALUE, 1)[1]
    if end_marker and end_marker in before_result:
        return ""
    stop = _through_first_special(before_result, stops)
    if stop:
        return _last_marker(stop, stops)
    if not closed:
        opening = before_result[len(os.path.commonprefix([before_result, closing])) :]
        return _last_marker(_through_first_special(opening, specials), specials)
    written = alone.rsplit(_PROBE_VALUE, 1)[0]
    call_start = written.rfind("lookup")
    inside = {token for token in specials if token in written[call_start:]} if call_start >= 0 else set()
    outside = tuple(token for token in specials if token not in inside)
    return _last_marker(_through_first_special(closing, outside), outside)


def _opens_a_turn(marker: str, generation_prompt: str) -> bool:
    """Whether `marker` is how the template opens a turn (it opens the generation prompt): a turn of calls that
    the template leaves unclosed (Command-R+'s `Action:` block) ends before it, not with it."""
    return bool(marker) and generation_prompt.lstrip().startswith(marker)


def _last_marker(text: str, markers: tuple[str, ...]) -> str:
    """The marker `text` ends with (the longest), or ""."""
    return max((marker for marker in markers if marker and text.endswith(marker)), key=len, default="")


def _between(render: Callable[..., str | None], first: dict[str, str], second: dict[str, str]) -> str:
    """What the template writes between two messages' texts ("" where it refuses them, or merges them)."""
    text = render([first, second]) or ""
    before, found, rest = text.partition(first["content"])
    return rest.split(second["content"], 1)[0] if found and second["content"] in rest else ""


def _through_last_special(text: str, specials: tuple[str, ...]) -> str:
    """`text` through its last special token, or "" without one."""
    ends = [text.rfind(token) + len(token) for token in specials if token and token in text]
    return text[: max(ends)] if ends else ""


def _opening_headers(
    reply_prefix: str, generation_prompt: str, other_openings: list[str], tokenizer: PreTrainedTokenizerBase
) -> tuple[str, ...]:
    """What may open an assistant turn, the longest first: the reply prefix and the generation prompt, and the
    generation prompt cut short at a token boundary (with what the reply prefix writes before it), down to the
    shortest cut that still says "assistant" (longer than anything it shares with how the template opens another
    turn). The generation prompt is the header of the reply being generated; a turn written earlier in a
    conversation may open with less of it (QwQ's and DeepSeek-R1's turns of tool calls open without the prompt's
    `<think>`; non-thinking prompts close an empty think block a turn of calls does not), and a reply then starts
    where its text stops following the generation prompt: what the template writes there (a call's wrapper, a
    think block) is what the model generated in that turn."""
    headers = [reply_prefix, generation_prompt]
    if generation_prompt:
        cuts = _cuts(generation_prompt, other_openings, tokenizer)
        before = reply_prefix[: -len(generation_prompt)] if reply_prefix.endswith(generation_prompt) else None
        headers += cuts + ([before + cut for cut in cuts] if before else [])
    elif reply_prefix:  # a template that writes the next header after every conversation (Command-R7B's): no prompt
        headers += _cuts(reply_prefix, other_openings, tokenizer)  # apart from the reply prefix, which is cut
    return tuple(dict.fromkeys(sorted((h for h in headers if h.strip()), key=len, reverse=True)))


def _cuts(header: str, other_openings: list[str], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """`header` cut short at each of its token boundaries past what it shares with another turn's opening."""
    shared = max((_longest_common_run(header, text) for text in other_openings), default=0)
    offsets = tokenizer(header, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [header[:end] for _, end in offsets if shared < end < len(header)]


def _longest_common_run(prefix_of: str, text: str) -> int:
    """The most characters that `prefix_of` begins with and that stand together anywhere in `text`."""
    longest = 0
    for start in range(len(text)):
        if text[start] == prefix_of[0]:
            longest = max(longest, len(os.path.commonprefix([prefix_of, text[start : start + len(prefix_of)]])))
    return longest


def _through_first_special(text: str, specials: tuple[str, ...]) -> str:
    """`text` through its first special token (the longest, where several start there), or "" without one: what
    the template writes to close a reply, when it writes a marker there."""
    found = [(text.find(token), token) for token in specials if token and token in text]
    position, token = min(found, default=(-1, ""), key=lambda pair: (pair[0], -len(pair[1])))
    return text[: position + len(token)] if position >= 0 else ""
