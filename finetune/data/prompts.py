"""The prompts `eval.generate` answers (`finetune.rollouts.generation`), from the eval split as read, before
tokenization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig, GenerateConfig
from finetune.data.chat import chat_messages, chat_tools, describe
from finetune.data.sources import SAMPLE_INDEX
from finetune.data.tokenize import detect_format
from finetune.errors import FinetuneError, first_line


@dataclass(frozen=True)
class Prompt:
    """A held-out prompt, tokenized as the model is asked it, and the reference its answer is scored against."""

    ids: list[int]
    reference: str


def generation_prompts(
    parts: list[datasets.Dataset], tokenizer: PreTrainedTokenizerBase, data: DataConfig, cfg: GenerateConfig
) -> list[Prompt]:
    """The first `cfg.samples` samples of the eval split (its sources in order) as prompts with references: a
    conversation up to its last assistant turn, rendered with the generation prompt (the reference: that turn's
    text); a prompt/completion sample's prompt (a conversation rendered alike, or text with the tokenizer's BOS),
    the reference its completion; a pair's prompt, the reference its chosen reply; `cfg.column` names the
    reference's column instead."""
    prompts: list[Prompt] = []
    for dataset in parts:
        columns = [c for c in dataset.column_names if c != SAMPLE_INDEX]
        prompt_only = "prompt" in columns and not {"completion", "chosen"} & set(columns)
        form = "prompt_only" if prompt_only else detect_format(columns, data.format)
        if form == "prompt_only" and cfg.column is None:
            raise FinetuneError(
                "eval.generate: the eval data has prompts and no completion to compare with; set eval.generate.column "
                "to the column holding the answers (e.g. answer)"
            )
        if form == "text":
            raise FinetuneError(
                "eval.generate answers prompts, and the eval data is plain text (no prompt or reply to tell apart); "
                "remove eval.generate or evaluate on conversations, prompt/completion samples or pairs"
            )
        if cfg.column is not None and cfg.column not in columns:
            raise FinetuneError(
                f"eval.generate.column={cfg.column} is not a column of the eval data ({', '.join(columns)}); name one "
                "of them, or leave it unset for the last assistant turn or the completion"
            )
        for position, sample in enumerate(dataset.select(range(min(len(dataset), cfg.samples - len(prompts))))):
            index = sample.get(SAMPLE_INDEX, position)
            ids, reference = _prompt(sample, form, tokenizer, index)
            if cfg.column is not None:
                reference = sample[cfg.column]
            if reference is None or not str(reference).strip():
                # An empty reference is in every completion (contains) and None would compare as the text "None".
                raise FinetuneError(
                    f"eval.generate: eval sample {index} has no reference to score against ("
                    f"{cfg.column or 'its reply'} is {reference!r}); give every answered sample one, or evaluate on "
                    "other data"
                )
            prompts.append(Prompt(ids, str(reference)))
        if len(prompts) == cfg.samples:
            break
    return prompts


def _prompt(
    sample: dict[str, Any], form: str, tokenizer: PreTrainedTokenizerBase, index: int
) -> tuple[list[int], str]:
    if form == "chat" or (form == "preference" and sample.get("prompt") is None):  # pairs: the chosen conversation
        messages = sample["messages" if form == "chat" else "chosen"]
        last = max((i for i, m in enumerate(messages or []) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise FinetuneError(f"eval.generate: eval sample {index} has no assistant turn to answer; fix the data")
        if last == 0:
            raise FinetuneError(f"eval.generate: eval sample {index} has nothing before its reply to answer; fix it")
        return prompt_tokens(messages[:last], sample.get("tools"), tokenizer, index), content_text(
            messages[last].get("content")
        )
    prompt = sample["prompt"]
    if form == "prompt_only":  # the reference is eval.generate.column's
        return prompt_tokens(prompt, sample.get("tools"), tokenizer, index), ""
    completion = sample["completion" if form == "prompt_completion" else "chosen"]
    if isinstance(completion, list):
        completion = completion[0].get("content") if completion and isinstance(completion[0], dict) else None
    return prompt_tokens(prompt, sample.get("tools"), tokenizer, index), content_text(completion)


def prompt_tokens(prompt: Any, tools: Any, tokenizer: PreTrainedTokenizerBase, index: int) -> list[int]:
    """A prompt as generation takes it: text tokenized (with the tokenizer's BOS if it adds one), or a conversation
    checked and rendered (`rendered`); anything else, an empty text or one of no tokens, a data error naming the
    sample."""
    if isinstance(prompt, list):
        return rendered(chat_messages(prompt, index), tokenizer, chat_tools(tools, index), index)
    if not isinstance(prompt, str):
        raise FinetuneError(
            f"sample {index}: the prompt is {describe(prompt)}; give each prompt as text or a list of messages"
        )
    ids = tokenizer(prompt)["input_ids"] if prompt.strip() else []
    if not ids:
        raise FinetuneError(
            f"sample {index}: the prompt is empty ({prompt!r}): there is nothing to answer; give it text, or remove "
            "the sample (data.invalid=drop leaves such samples out, counted)"
        )
    return ids


def rendered(messages: list[dict], tokenizer: PreTrainedTokenizerBase, tools: Any, index: int = -1) -> list[int]:
    """A conversation rendered for the model to answer: with the template's generation prompt, or, when it ends with
    an assistant message (a prefill), with that message left open for the model to continue (as TRL does)."""
    prefill = messages[-1].get("role") == "assistant"
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
        )
    except Exception as exc:  # the template's own exceptions (jinja2's, raise_exception) name no sample
        raise FinetuneError(
            f"sample {index}: the chat template cannot render the prompt ({type(exc).__name__}: {first_line(exc)}); "
            "fix the sample, or set data.chat_template to a template that renders it"
        ) from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def content_text(content: Any) -> str:
    """A message's content as text: parts' texts joined, None as empty."""
    if isinstance(content, list):  # parts: the text ones joined
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)
