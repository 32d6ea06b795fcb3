"""The prompts `eval.generate` answers (`finetune.generation`), from the eval split as read, before tokenization."""

from __future__ import annotations

from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.config import DataConfig, GenerateConfig
from finetune.data.tokenize import detect_format
from finetune.errors import FinetuneError
from finetune.generation import Prompt


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
        prompt_only = "prompt" in dataset.column_names and not {"completion", "chosen"} & set(dataset.column_names)
        form = "prompt_only" if prompt_only else detect_format(dataset.column_names, data.format)
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
        if cfg.column is not None and cfg.column not in dataset.column_names:
            raise FinetuneError(
                f"eval.generate.column={cfg.column} is not a column of the eval data "
                f"({', '.join(dataset.column_names)}); name one of them, or leave it unset for the last assistant "
                "turn or the completion"
            )
        for sample in dataset.select(range(min(len(dataset), cfg.samples - len(prompts)))):
            ids, reference = _prompt(sample, form, tokenizer)
            prompts.append(Prompt(ids, str(sample[cfg.column]) if cfg.column is not None else reference))
        if len(prompts) == cfg.samples:
            break
    return prompts


def _prompt(sample: dict[str, Any], form: str, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], str]:
    if form == "chat" or (form == "preference" and sample.get("prompt") is None):  # pairs: the chosen conversation
        messages = sample["messages" if form == "chat" else "chosen"]
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise FinetuneError("eval.generate: an eval conversation has no assistant turn to answer; fix the data")
        return rendered(messages[:last], tokenizer, sample.get("tools")), _text(messages[last].get("content"))
    prompt = sample["prompt"]
    if form == "prompt_only":  # the reference is eval.generate.column's
        return (rendered(prompt, tokenizer, sample.get("tools")) if isinstance(prompt, list) else
                tokenizer(prompt)["input_ids"]), ""  # fmt: skip
    completion = sample["completion" if form == "prompt_completion" else "chosen"]
    if isinstance(prompt, list):
        reference = completion[0].get("content") if isinstance(completion, list) else completion
        return rendered(prompt, tokenizer, sample.get("tools")), _text(reference)
    return tokenizer(prompt)["input_ids"], _text(completion)


def rendered(messages: list[dict], tokenizer: PreTrainedTokenizerBase, tools: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _text(content: Any) -> str:
    if isinstance(content, list):  # parts: the text ones joined
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)
