"""Chat templates: a recipe's read and checked, and what a template writes around replies (its shape: headers,
end-of-turn markers), learned once per template by rendering probe conversations."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from finetune.data.chat.messages import REASONING_FIELDS
from finetune.errors import FinetuneError, first_line


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


_PROBE_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}  # fmt: skip


_PROBE_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "probe"}}}


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
