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

from finetune.data.chat.messages import (
    REASONING_FIELDS,
    chat_messages,
    chat_tools,
    describe,
    message_role,
    unclosed_think,
)
from finetune.data.chat.replies import MultiTurn, RenderedChat, RenderedChats, probe_template, render_chats
from finetune.data.chat.templates import (
    TemplateShape,
    names_a_template,
    read_chat_template,
    reasoning_field,
    template_shape,
)
from finetune.data.chat.tokens import EncodedSamples, encode_chats, encode_rendered, encodings, token_ranges

__all__ = [
    "REASONING_FIELDS", "EncodedSamples", "MultiTurn", "RenderedChat", "RenderedChats", "TemplateShape",
    "chat_messages",
    "chat_tools", "describe", "encode_chats", "encode_rendered", "encodings", "message_role", "names_a_template",
    "probe_template", "read_chat_template", "reasoning_field", "render_chats", "template_shape", "token_ranges",
    "unclosed_think",
]  # fmt: skip
