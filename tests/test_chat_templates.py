"""Assistant-only loss on chat templates that rewrite the conversation.

Each template here is a small one written for the test that reproduces one behaviour of a popular
family's real template (dates in a system header, default system prompts, BOS in the template,
trimmed content, a system message moved or dropped, reasoning stripped or added, an end-of-text
token after the last turn, refused roles). For each: the trained tokens are exactly the assistant
replies as the rendered conversation contains them, with the turn's end marker, and the ids are the
rendered text tokenized once.
"""

from __future__ import annotations

import json
import re

import datasets
import pytest
from transformers import AutoTokenizer

from finetune.config import DataConfig
from finetune.data import IGNORE, encode_chats, prepare_split
from finetune.data.chat import chat_messages, render_chats
from finetune.errors import FinetuneError

LLAMA_3_1 = r"""{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content | trim %}{% set messages = messages[1:] %}
{%- else %}{% set system = '' %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n'
    + system + '<|eot_id|>' }}
{%- for m in messages %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

LLAMA_3_2 = LLAMA_3_1.replace("26 Jul 2024", "' + strftime_now('%d %b %Y') + '")

QWEN_2_5 = r"""{%- if messages[0].role != 'system' %}
{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{% endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}"""

SMOLLM_2 = QWEN_2_5.replace("You are Qwen, a helpful assistant.", "You are SmolLM, a small assistant.")

GEMMA_3 = r"""{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set first = messages[0].content | trim + '\n\n' %}
{%- set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}
{%- for m in messages %}
{%- set role = 'model' if m.role == 'assistant' else m.role %}
{{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m.content | trim + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{% endif %}"""

MISTRAL_V0_3 = r"""{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}
{%- set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}
{{- bos_token }}
{%- for m in turns %}
{%- if m.role == 'user' %}
{%- if loop.last and system is defined %}{{- '[INST] ' + system + '\n\n' + m.content + '[/INST]' }}
{%- else %}{{- '[INST] ' + m.content + '[/INST]' }}{% endif %}
{%- else %}{{- ' ' + m.content | trim + eos_token }}{% endif %}
{%- endfor %}"""

QWEN_3 = r"""{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- set content = m.content %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is defined else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_user %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content + '<|im_end|>\n' }}
{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{% endif %}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}"""

DEEPSEEK_R1_DISTILL = r"""{{- bos_token }}
{%- for m in messages %}
{%- if m.role == 'user' %}{{- '<|User|>' + m.content }}
{%- elif m.role == 'assistant' %}{{- '<|Assistant|>' + m.content.split('</think>')[-1] + eos_token }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|Assistant|>' }}{% endif %}"""

PHI_3 = r"""{%- for m in messages %}{{- '<|' + m.role + '|>\n' + m.content + '<|end|>\n' }}{% endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{% else %}{{- eos_token }}{% endif %}"""

GEMMA_2 = r"""{%- if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
{{- bos_token }}
{%- for m in messages %}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}
{%- set role = 'model' if m.role == 'assistant' else m.role %}
{{- '<start_of_turn>' + role + '\n' + m.content | trim + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{% endif %}"""

# A template that keeps only the last reply's text (earlier ones summarized): no single rendering holds them all.
LAST_REPLY_ONLY = r"""{%- for m in messages %}
{%- if m.role == 'assistant' and not loop.last %}{{- '<|assistant|>\n(earlier reply)<|end|>\n' }}
{%- else %}{{- '<|' + m.role + '|>\n' + m.content + '<|end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{% endif %}"""

# Qwen2.5-style tool calling: schemas in a system block, calls inside the reply, results as user turns.
TOOLS = r"""{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}
{%- for t in tools %}{{- '\n' + (t | tojson) }}{% endfor %}{{- '\n</tools><|im_end|>\n' }}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant' }}{% if m.content %}{{- '\n' + m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}
{{- '\n<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}"""

# gpt-oss's harmony format: a system header of its own, the data's system message as a developer message, replies
# on the final channel closed by <|end|>, except the conversation's last, closed by <|return|> (where generation
# stops); the last reply's `thinking` on an analysis channel before it, earlier replies' dropped.
HARMONY = r"""{{- '<|start|>system<|message|>You are ChatGPT, a large language model.\nReasoning: medium<|end|>' }}
{%- if messages[0].role == 'system' %}{{- '<|start|>developer<|message|># Instructions\n\n' + messages[0].content
    + '<|end|>' }}{% set messages = messages[1:] %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- if m.thinking and loop.last %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}
{%- endif %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content }}
{%- if loop.last and not add_generation_prompt %}{{- '<|return|>' }}{% else %}{{- '<|end|>' }}{% endif %}
{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{% endif %}"""

# template, bos, eos, pad, other special tokens
FAMILIES = {
    "llama-3.1": (LLAMA_3_1, "<|begin_of_text|>", "<|eot_id|>", None, ["<|start_header_id|>", "<|end_header_id|>"]),
    "llama-3.2": (LLAMA_3_2, "<|begin_of_text|>", "<|eot_id|>", None, ["<|start_header_id|>", "<|end_header_id|>"]),
    "qwen-2.5": (QWEN_2_5, None, "<|im_end|>", "<|endoftext|>", ["<|im_start|>"]),
    "smollm-2": (SMOLLM_2, None, "<|im_end|>", "<|im_end|>", ["<|im_start|>"]),
    "gemma-3": (GEMMA_3, "<bos>", "<eos>", "<pad>", ["<start_of_turn>", "<end_of_turn>"]),
    "mistral-v0.3": (MISTRAL_V0_3, "<s>", "</s>", None, ["[INST]", "[/INST]"]),
    "qwen-3": (QWEN_3, None, "<|im_end|>", "<|endoftext|>", ["<|im_start|>", "<think>", "</think>"]),
    "deepseek-r1-distill": (DEEPSEEK_R1_DISTILL, "<bos>", "<eos>", None, ["<|User|>", "<|Assistant|>"]),
    "phi-3": (PHI_3, None, "<|endoftext|>", "<|endoftext|>", ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]),
    "gemma-2": (GEMMA_2, "<bos>", "<eos>", "<pad>", ["<start_of_turn>", "<end_of_turn>"]),
    "tools": (TOOLS, None, "<|im_end|>", "<|endoftext|>", ["<|im_start|>", "<tool_call>", "</tool_call>"]),
    "last-reply-only": (LAST_REPLY_ONLY, None, "<|endoftext|>", None, ["<|user|>", "<|assistant|>", "<|end|>"]),
    "gpt-oss": (HARMONY, None, "<|return|>", None, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>"]),
}


@pytest.fixture(scope="module")
def base_tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets / "base")


def family_tokenizer(base_tokenizer, family: str):
    """The demo's byte-level tokenizer, with the family's special tokens and template."""
    template, bos, eos, pad, others = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer.name_or_path)
    specials = {"eos_token": eos, "additional_special_tokens": others}
    if bos:
        specials["bos_token"] = bos
    tokenizer.add_special_tokens(specials | ({"pad_token": pad} if pad else {}))
    tokenizer.chat_template = template
    return tokenizer


def turns(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


def trained_and_ids(tokenizer, messages: list[dict], **options) -> tuple[str, list[int], str]:
    [(ids, trained)] = encode_chats([messages], tokenizer, True, **options)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # the rendered text, tokenized once
    return tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]), ids, text


SYSTEM_MULTI_TURN = turns(
    ("system", "  Be brief. "), ("user", "reverse: 1 2"), ("assistant", " 2 1 "), ("user", "and 3 4"),
    ("assistant", "4 3"),
)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("llama-3.1", "2 1<|eot_id|>4 3<|eot_id|>"),  # trimmed, after a dated system header
        ("llama-3.2", "2 1<|eot_id|>4 3<|eot_id|>"),  # today's date in the header
        ("qwen-2.5", " 2 1 <|im_end|>4 3<|im_end|>"),
        ("gemma-3", "2 1<end_of_turn>4 3<end_of_turn>"),  # system merged into the first user turn
        ("mistral-v0.3", " 2 1</s> 4 3</s>"),  # system dropped: the conversation ends with a reply
        ("phi-3", " 2 1 <|end|>4 3<|end|>"),  # <|endoftext|> after the last turn is not the reply's
        # harmony: the last reply closes with <|return|>, the token generation stops at, trained as its end marker
        ("gpt-oss", "<|channel|>final<|message|> 2 1 <|end|><|channel|>final<|message|>4 3<|return|>"),
    ],
)
def test_replies_are_trained_with_their_end_marker_and_nothing_else(base_tokenizer, family, expected):
    tokenizer = family_tokenizer(base_tokenizer, family)
    trained, ids, text = trained_and_ids(tokenizer, SYSTEM_MULTI_TURN)
    assert trained == expected
    assert "Be brief." not in trained and "reverse" not in trained
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS only: none added on top


def test_default_system_prompts_and_a_pad_equal_to_eos(base_tokenizer):
    """SmolLM2: a system prompt the data never gave; <|im_end|> is both pad and end of turn: it is trained."""
    tokenizer = family_tokenizer(base_tokenizer, "smollm-2")
    trained, ids, text = trained_and_ids(tokenizer, turns(("user", "hi"), ("assistant", "hello")))
    assert "You are SmolLM" in text and trained == "hello<|im_end|>"
    cfg = DataConfig(train_path="x", max_length=256, packing=False)
    data = datasets.Dataset.from_list([{"messages": turns(("user", "hi"), ("assistant", "hello"))}] * 2)
    rows, _ = prepare_split(data, tokenizer, cfg, seed=0)
    targets = [t for t in rows[0]["target_ids"] if t != IGNORE]
    assert targets[-1] == tokenizer.pad_token_id == tokenizer.eos_token_id


def test_reasoning_is_rendered_as_the_template_wants_and_trained_in_the_last_reply(base_tokenizer):
    """Qwen3: reasoning dropped from earlier replies, a think block (empty if none was given) in the last."""
    tokenizer = family_tokenizer(base_tokenizer, "qwen-3")
    messages = turns(
        ("user", "reverse: 1 2"), ("assistant", "<think>swap them</think>2 1"), ("user", "and 3 4"),
        ("assistant", "<think>\nswap again\n</think>\n\n4 3"),
    )  # fmt: skip
    trained, _, text = trained_and_ids(tokenizer, messages)
    assert "swap them" not in text
    assert trained == "2 1<|im_end|><think>\nswap again\n</think>\n\n4 3<|im_end|>"
    given = [*messages[:3], {"role": "assistant", "content": "4 3", "reasoning_content": "swap again"}]
    assert trained_and_ids(tokenizer, given)[0] == trained  # the same from a reasoning_content field
    plain = trained_and_ids(tokenizer, turns(("user", "q"), ("assistant", "a")))[0]
    assert plain == "<think>\n\n</think>\n\na<|im_end|>"


def test_reasoning_removed_from_every_reply(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "deepseek-r1-distill")
    messages = turns(("user", "q"), ("assistant", "<think>hmm</think>a"), ("user", "q2"), ("assistant", "b"))
    assert trained_and_ids(tokenizer, messages)[0] == "a<eos>b<eos>"


def test_a_template_that_refuses_a_conversation_names_the_sample(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "gemma-2")
    assert trained_and_ids(tokenizer, turns(("user", "q"), ("assistant", " a ")))[0] == "a<end_of_turn>"
    with pytest.raises(FinetuneError, match="sample 5: the tokenizer's chat template refuses it .*System role not"):
        encode_chats([SYSTEM_MULTI_TURN], tokenizer, True, indices=[5])
    with pytest.raises(FinetuneError, match="sample 5: .*roles must alternate"):
        encode_chats([turns(("user", "q"), ("user", "q"), ("assistant", "a"))], tokenizer, True, indices=[5])


def test_replies_no_rendering_holds_together_are_expanded_per_turn_or_refused(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "last-reply-only")
    messages = turns(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
    with pytest.raises(FinetuneError, match="sample 3: .*cannot be located in it; set data.multi_turn=per_turn"):
        encode_chats([messages], tokenizer, True, indices=[3])
    assert trained_and_ids(tokenizer, messages, multi_turn="last")[0] == "a2<|end|>"
    samples = render_chats([messages], tokenizer, True, multi_turn="per_turn")
    assert [s.expanded for s in samples] == [True, True]
    assert [[s.text[a:b] for a, b in s.spans] for s in samples] == [["a1<|end|>"], ["a2<|end|>"]]
    # Each sample's prompt is what the template renders for generation at that turn.
    for sample, upto in zip(samples, (1, 3), strict=True):
        prompt = tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=True)
        assert sample.text.startswith(prompt) and sample.spans[0][0] == len(prompt)
    # Conversations that do not need it stay whole, and the log counts the ones that did.
    data = datasets.Dataset.from_list([{"messages": messages}, {"messages": messages[:2]}])
    _, stats = prepare_split(data, tokenizer, DataConfig(train_path="x", max_length=256, multi_turn="per_turn"), 0)
    assert stats.num_samples == 3 and stats.num_expanded == 2
    assert "3 samples, 2 of them per-turn samples of expanded conversations" in stats.describe("train data")


HASH_TEMPLATE = r"""{{- bos_token }}
{%- for m in messages %}{{- '### ' + m.role + ':\n' + m.content + '<|end|>\n' }}{% endfor %}
{%- if add_generation_prompt %}{{- '### assistant:\n' }}{% endif %}"""


@pytest.mark.multiprocess
def test_a_recipe_chat_template_trains_and_travels_with_the_export(demo_assets, tmp_path):
    """data.chat_template from a file replaces the tokenizer's; the exported folder carries it, so a reload
    renders prompts exactly as training rendered them."""
    from helpers import LaunchedRun, launch, recipe_overrides

    template = tmp_path / "hash.jinja"
    template.write_text(HASH_TEMPLATE)
    overrides = {"data.chat_template": template, "train.max_steps": 2, "train.eval_every_steps": 0}
    result = launch("fsdp2_full_shard.yaml", recipe_overrides(demo_assets, tmp_path / "out", **overrides))
    assert result.returncode == 0, result.stderr[-4000:]
    run = LaunchedRun(result, tmp_path / "out")
    exported = AutoTokenizer.from_pretrained(run.output_dir / "final")
    assert exported.chat_template == HASH_TEMPLATE
    messages = turns(("user", "reverse: 1 2"), ("assistant", "2 1"))
    prompt = exported.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    [sample] = render_chats([messages], exported, True)
    assert sample.text.startswith(prompt) and sample.spans == [(len(prompt), len(prompt) + len("2 1<|end|>"))]


def test_a_chat_template_that_is_missing_or_not_jinja_is_refused(tmp_path):
    from finetune.data import check_sources
    from finetune.data.chat import read_chat_template

    def check(value: str) -> None:
        check_sources(DataConfig(train_path="org/data", max_length=8, chat_template=value))

    for missing in (tmp_path / "missing.jinja", tmp_path / "templates" / "chatml", "missing.jinja"):  # a path
        with pytest.raises(FinetuneError, match=f"data.chat_template {missing} does not exist; point it at a templ"):
            check(str(missing))
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(FinetuneError, match="data.chat_template file .*empty.jinja is empty; write the template"):
        check(str(tmp_path / "empty.jinja"))
    with pytest.raises(FinetuneError, match="data.chat_template is not a valid Jinja template"):
        check("{% for m in messages %}")
    with pytest.raises(FinetuneError, match="cannot render a conversation .*it writes no user or assistant message"):
        check("{{ bos_token }}{% for m in messages %}{{ m.role }}{% endfor %}")
    # A bare name may be one of the tokenizer's named templates: checked when it loads, refused if not one.
    check("chatml")
    with pytest.raises(
        FinetuneError, match="chatml is neither a file nor a Jinja template nor one of the tokenizer's"
    ):
        read_chat_template("chatml", {"default": HASH_TEMPLATE, "tool_use": TOOLS})
    assert read_chat_template("tool_use", {"default": HASH_TEMPLATE, "tool_use": TOOLS}) == TOOLS
    (tmp_path / "ok.jinja").write_text(HASH_TEMPLATE)
    assert read_chat_template(str(tmp_path / "ok.jinja")) == HASH_TEMPLATE
    assert read_chat_template(GEMMA_2) == GEMMA_2  # refuses system messages: checked without one


def test_named_chat_templates_train_with_the_default_or_the_one_named(base_tokenizer, tmp_path):
    """Tokenizers that ship a dict of named templates (Hermes-2-Pro, Command-R) render with the default one,
    or the one data.chat_template names; saved with the default resolved, as exports carry it."""
    from finetune.config import ModelConfig
    from finetune.model.loading import load_tokenizer

    tokenizer = family_tokenizer(base_tokenizer, "qwen-2.5")
    tokenizer.chat_template = {"default": QWEN_2_5, "tool_use": TOOLS}
    tokenizer.save_pretrained(tmp_path / "named")
    assert isinstance(AutoTokenizer.from_pretrained(tmp_path / "named").chat_template, dict)
    cfg = ModelConfig(name_or_path=str(tmp_path / "named"))
    assert load_tokenizer(cfg).chat_template == QWEN_2_5
    loaded = load_tokenizer(cfg, "tool_use")
    assert loaded.chat_template == TOOLS
    [(ids, trained)] = encode_chats([TOOL_CHAT], loaded, True)
    assert "It is sunny." in loaded.decode([i for i, t in zip(ids, trained, strict=True) if t])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny."},
]


def test_tool_calls_are_trained_and_tool_results_and_schemas_are_not(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "tools")
    [(ids, trained)] = encode_chats([TOOL_CHAT], tokenizer, True, tools=[json.dumps([WEATHER])])
    text = tokenizer.apply_chat_template(TOOL_CHAT, tools=[WEATHER], tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] and "Weather of a city" in text
    assert tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "It is sunny.<|im_end|>"
    )
    # Through the data pipeline, as a dataset column (Arrow fills absent keys with nulls; they are dropped).
    data = datasets.Dataset.from_list([{"messages": TOOL_CHAT, "tools": json.dumps([WEATHER])}] * 2)
    rows, stats = prepare_split(data, tokenizer, DataConfig(train_path="x", max_length=512, packing=False), 0)
    assert stats.num_target_tokens == 2 * sum(trained[1:]) and stats.num_truncated == 0


@pytest.mark.parametrize(
    ("messages", "tools", "message"),
    [
        (TOOL_CHAT, "{not json", "sample 4: tools is not valid JSON"),
        (TOOL_CHAT, json.dumps({"name": "x"}), "sample 4: tools must be a list of JSON schemas"),
        (
            [TOOL_CHAT[0], TOOL_CHAT[2], TOOL_CHAT[3]],
            None,
            "sample 4, message 1 is a tool result that answers no tool call",
        ),
    ],
)
def test_bad_tool_data_names_the_sample(base_tokenizer, messages, tools, message):
    tokenizer = family_tokenizer(base_tokenizer, "tools")
    with pytest.raises(FinetuneError, match=message):
        encode_chats([messages], tokenizer, True, indices=[4], tools=[tools])


def test_reasoning_can_be_kept_as_context_only_and_is_counted(base_tokenizer):
    """data.train_on_reasoning=false: the think block's text stays in the sample but takes no loss; both a
    reasoning_content field (Qwen3) and a <think> block kept in the content (a plain template) count."""
    qwen3 = family_tokenizer(base_tokenizer, "qwen-3")
    messages = turns(("user", "reverse: 3 4"), ("assistant", "<think>swap them</think>4 3"))
    [rendered] = render_chats([messages], qwen3, True)
    [kept] = [rendered.text[a:b] for a, b in rendered.reasoning]
    assert kept == "swap them"
    cfg = DataConfig(train_path="x", max_length=256, packing=False, train_on_reasoning=False)
    rows, stats = prepare_split(datasets.Dataset.from_list([{"messages": messages}]), qwen3, cfg, 0)
    trained = qwen3.decode([t for t in rows[0]["target_ids"] if t != IGNORE])
    assert trained == "<think>\n\n</think>\n\n4 3<|im_end|>" and "swap them" in qwen3.decode(rows[0]["input_ids"])
    assert stats.num_reasoning_tokens == len(qwen3("swap them", add_special_tokens=False)["input_ids"])
    assert "of reasoning (not trained)" in stats.describe("train data")
    phi3 = family_tokenizer(base_tokenizer, "phi-3")
    [rendered] = render_chats([messages], phi3, True)
    assert [rendered.text[a:b] for a, b in rendered.reasoning] == ["swap them"]
    [(ids, trained_mask)] = encode_chats([messages], phi3, True)
    assert "swap them" in phi3.decode([i for i, t in zip(ids, trained_mask, strict=True) if t])  # trained by default


CONVERSATIONS = {
    "plain": turns(("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "and 3 4"), ("assistant", "4 3")),
    "system, spaces": SYSTEM_MULTI_TURN,
    "reasoning": turns(("user", "q"), ("assistant", "<think>hmm</think>a"), ("user", "q2"), ("assistant", "b")),
    "reasoning field": [*turns(("user", "q")), {"role": "assistant", "content": "a", "reasoning_content": "hmm"}],
    "tools": TOOL_CHAT,
}


def test_the_skeleton_path_locates_replies_exactly_as_the_placeholder_rendering_does(base_tokenizer):
    """Replies are located from one skeleton per conversation structure when the template copies texts as
    they are (`filled_spans`), from the pieces' lengths alone where the skeleton holds each reply's header
    and end marker next to it (its layout); each such result equals the reference's (`_reply_spans`, which
    renders each conversation again with placeholders), and templates that trim or rewrite texts fall back to it."""
    from finetune.data.chat import template_shape
    from finetune.data.chat.rendering import check_batch
    from finetune.data.chat.replies import _reply_spans
    from finetune.data.chat.skeleton import filled_spans, skeletons_of

    fast, laid = set(), set()
    for family in FAMILIES:
        tokenizer = family_tokenizer(base_tokenizer, family)
        for name, conversation in CONVERSATIONS.items():
            tools = [WEATHER] if name == "tools" else None
            if name == "tools" and "tool_calls" not in tokenizer.chat_template:
                with pytest.raises(FinetuneError, match="never renders"):  # calls it would drop are refused
                    check_batch([conversation], [tools], [0], tokenizer)
                continue
            batch = check_batch([conversation], [tools], [0], tokenizer)
            chat = batch.chat(0)
            try:
                text = chat.render()
            except FinetuneError:  # gemma-2 refuses system roles
                continue
            [(skeleton, values)] = skeletons_of(batch, template_shape(tokenizer))
            replies = tuple(i for i, message in enumerate(chat.messages) if message["role"] == "assistant")
            for trained in (replies, replies[-1:]):
                located = filled_spans(skeleton, values, trained, text)
                if located is not None and trained == replies:
                    fast.add((family, name))
                    if skeleton.placed(trained)[1] is not None:
                        laid.add((family, name))
                if located is not None:
                    assert located == _reply_spans(chat, template_shape(tokenizer), trained, text), (family, name)
    # Without surrounding spaces, trimming changes nothing: every template but the one that drops earlier
    # replies takes the skeleton path.
    assert {family for family, name in fast if name == "plain"} == set(FAMILIES) - {"last-reply-only"}
    assert ("llama-3.1", "system, spaces") not in fast  # trimmed texts: located by the reference path
    assert ("qwen-3", "reasoning field") in fast and ("tools", "tools") in fast
    assert {family for family, name in laid if name == "plain"} == {family for family, name in fast if name == "plain"}
    assert ("qwen-3", "reasoning field") in laid and ("tools", "tools") in laid


def test_encodings_asked_of_the_backend_equal_the_tokenizers_own(base_tokenizer):
    """The backend is asked directly only where the tokenizer's call would set nothing on it: a backend left
    truncating, or a tokenizer told to split special tokens, goes through the tokenizer's call."""
    from finetune.data.chat import encodings

    tokenizer = family_tokenizer(base_tokenizer, "qwen-2.5")
    texts = ["<|im_start|>user\nreverse: 1 2<|im_end|>\n", "é 🙂 漢字 <|im_end|>ab "]

    def ids() -> list[list[int]]:
        return [encoding.ids for encoding in encodings(tokenizer, texts)]

    whole = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert ids() == whole
    tokenizer.backend_tokenizer.enable_truncation(3)
    assert ids() == whole and tokenizer.backend_tokenizer.truncation is None
    tokenizer.split_special_tokens = True
    assert ids() == tokenizer(texts, add_special_tokens=False)["input_ids"] != whole


def test_trained_tokens_are_found_from_character_spans_as_by_bisecting_every_offset(base_tokenizer):
    """Spans map to tokens through the encoding's char_to_token at their bounds; the reference converts
    every token's offsets and bisects. Texts with merges across the bounds, multi-byte characters split
    into byte tokens, and special tokens."""
    import bisect
    import random

    from finetune.data.chat import token_ranges

    tokenizer = family_tokenizer(base_tokenizer, "qwen-2.5")
    generator = random.Random(0)
    pieces = ["reverse", " 1", "2 ", "  ", "\n", "é", "🙂", "漢字", "<|im_start|>", "<|im_end|>", "a", "ab "]
    for _ in range(200):
        text = "".join(generator.choice(pieces) for _ in range(generator.randint(1, 12)))
        bounds = sorted(generator.randint(0, len(text)) for _ in range(4))
        spans = [(bounds[0], bounds[1]), (bounds[2], bounds[3])]
        encoded = tokenizer([text], add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in encoded["offset_mapping"][0]]
        ends = [end for _, end in encoded["offset_mapping"][0]]
        expected = [(bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)) for lo, hi in spans]
        assert token_ranges(encoded.encodings[0], spans, len(starts), len(text)) == expected, (text, spans)
        # covering: the first token is the first that ends after lo (one that starts before it and runs into it)
        expected = [(bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)) for lo, hi in spans]
        got = token_ranges(encoded.encodings[0], spans, len(starts), len(text), covering=True)
        assert got == expected, (text, spans)


def test_sharegpt_turns_with_tool_calls_in_their_text(base_tokenizer):
    """Hermes-style ShareGPT data: `from` / `value` turns, the tools in the system text, calls written into
    the reply's text, results as `tool` turns. Trained exactly as the same conversation given as messages:
    the replies (calls included), not the results."""
    tokenizer = family_tokenizer(base_tokenizer, "qwen-2.5")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    sharegpt = [
        {"from": "system", "value": "You may call get_weather."}, {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": call}, {"from": "tool", "value": '{"sky": "sunny"}'},
        {"from": "gpt", "value": "It is sunny."},
    ]  # fmt: skip
    roles = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
    messages = [{"role": roles[turn["from"]], "content": turn["value"]} for turn in sharegpt]
    trained, ids, _ = trained_and_ids(tokenizer, messages)
    assert encode_chats([sharegpt], tokenizer, True) == [(ids, encode_chats([messages], tokenizer, True)[0][1])]
    assert trained == call + "<|im_end|>It is sunny.<|im_end|>"
    data = datasets.Dataset.from_list([{"messages": sharegpt}] * 2)  # through Arrow and the pipeline
    _, stats = prepare_split(data, tokenizer, DataConfig(train_path="x", max_length=512, packing=False), 0)
    assert stats.num_target_tokens == 2 * len(tokenizer(trained, add_special_tokens=False)["input_ids"])


def test_replies_of_weight_0_are_context_and_weight_1_trains(base_tokenizer):
    """OpenAI's chat format marks a turn not to train with "weight": 0; 1 (or no weight) trains it."""
    tokenizer = family_tokenizer(base_tokenizer, "qwen-2.5")
    messages = turns(("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "again"), ("assistant", "1 2"))
    weighted = [messages[0], {**messages[1], "weight": 0}, messages[2], {**messages[3], "weight": 1}]
    trained, ids, _ = trained_and_ids(tokenizer, weighted)
    assert trained == "1 2<|im_end|>" and ids == trained_and_ids(tokenizer, messages)[1]
    nothing = [messages[0], {**messages[1], "weight": 0}]
    data = datasets.Dataset.from_list([{"messages": nothing}, {"messages": weighted}])
    _, stats = prepare_split(data, tokenizer, DataConfig(train_path="x", max_length=512, packing=False), 0)
    assert stats.num_dropped == 1  # a conversation with no reply to train is counted as dropped, not trained
    with pytest.raises(FinetuneError, match=r"sample 0, message 1: weight 0.5 .* on assistant messages only"):
        encode_chats([[messages[0], {**messages[1], "weight": 0.5}]], tokenizer, True)
    with pytest.raises(FinetuneError, match="marks replies with weight 0 .* data.completion_only_loss=false"):
        encode_chats([weighted], tokenizer, False)


def test_reasoning_the_template_does_not_take_is_written_as_a_think_block_and_counted(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "qwen-2.5")  # renders no reasoning_content
    messages = [*turns(("user", "q")), {"role": "assistant", "content": "a", "reasoning_content": "hmm"}]
    trained, _, text = trained_and_ids(tokenizer, [*turns(("user", "q")), *turns(("assistant", "a"))])
    [sample] = render_chats([messages], tokenizer, True)
    assert "<think>\nhmm\n</think>\n\na<|im_end|>" in sample.text
    for train_on_reasoning, expected in ((True, "<think>\nhmm\n</think>\n\na<|im_end|>"), (False, None)):
        cfg = DataConfig(train_path="x", max_length=512, packing=False, train_on_reasoning=train_on_reasoning)
        rows, stats = prepare_split(datasets.Dataset.from_list([{"messages": messages}]), tokenizer, cfg, 0)
        assert stats.num_reasoning_tokens >= len(tokenizer("hmm", add_special_tokens=False)["input_ids"])
        targets = [t for t in rows[0]["target_ids"] if t != IGNORE]
        if expected is not None:
            assert tokenizer.decode(targets) == expected
        else:
            assert "hmm" not in tokenizer.decode(targets) and tokenizer.decode(targets).endswith("a<|im_end|>")


@pytest.mark.parametrize(
    ("messages", "tools", "family", "message"),
    [
        (turns(("user", "q"), ("assistant", "<think>cut off")), None, "qwen-2.5", "sample 0: a reply opens <think>"),
        (turns(("user", "q"), ("assistant", "<think>cut off")), None, "qwen-3", "sample 0: a reply opens <think>"),
        (TOOL_CHAT, None, "qwen-2.5", "sample 0, message 1 has tool_calls, which the chat template never renders"),
        (TOOL_CHAT[:1] + TOOL_CHAT[3:], [WEATHER], "qwen-2.5", "sample 0 has tools, which the chat template never"),
        (turns(("user", "q"), ("assistant", "")), None, "qwen-2.5", "message 1 is an empty assistant reply"),
        ([{"from": "human", "value": "q"}, {"from": "wizard", "value": "a"}], None, "qwen-2.5",
         "sample 0: a ShareGPT turn is from 'wizard', a speaker finetune does not know"),
        ([TOOL_CHAT[0], {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": Paris}'}}]}],
         None, "tools", "the arguments of tool call 'get_weather' are not a JSON object"),
    ],
)  # fmt: skip
def test_what_a_template_would_drop_or_train_wrongly_is_refused(base_tokenizer, messages, tools, family, message):
    with pytest.raises(FinetuneError, match=re.escape(message)):
        encode_chats([messages], family_tokenizer(base_tokenizer, family), True, tools=[tools])


def test_tool_call_arguments_given_as_json_text_render_as_objects(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "tools")
    as_text = json.loads(json.dumps(TOOL_CHAT))
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'  # OpenAI's wire format
    assert render_chats([as_text], tokenizer, True)[0].text == render_chats([TOOL_CHAT], tokenizer, True)[0].text
    sharegpt = [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"name": "f"}'},
                {"from": "observation", "value": "r"}, {"from": "chatbot", "value": "a"}]  # fmt: skip
    assert [m["role"] for m in chat_messages(sharegpt, 0)] == ["user", "assistant", "tool", "assistant"]


# A template that writes a space between the tool results and the reply (as Mistral-v0.3's does); a reply
# after a tool result has no header of its own, so its first token starts with the template's space.
SPACE_BEFORE_REPLY = r"""{{- bos_token }}
{%- for m in messages %}
{%- if m.role == 'user' %}{{- '[INST] ' + m.content + '[/INST]' }}
{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS] ' + m.content + '[/TOOL_RESULTS]' }}
{%- elif m.tool_calls %}{{- '[TOOL_CALLS] ' + (m.tool_calls | map(attribute='function') | list | tojson) + eos_token }}
{%- else %}{{- ' ' + m.content + eos_token }}{% endif %}
{%- endfor %}"""
SPACE_SPECIALS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def trained_tokenizer(kind: str):
    """A tokenizer trained here on a few lines, of either kind the hub's models use: byte-level BPE (GPT-2,
    Llama 3, Qwen: a space is the byte 'Ġ' glued to the next word) or SentencePiece-style (Llama 2, Mistral:
    '▁' glued to the next word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    special_tokens = ["<unk>", "<s>", "</s>", *SPACE_SPECIALS]
    if kind == "byte-level BPE":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens, initial_alphabet=alphabet)
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens)
    lines = ["Yes. It is sunny in Paris today.", "Weather in Paris?", 'get_weather {"city": "Paris"} sky sunny']
    backend.train_from_iterator(lines * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=SPACE_SPECIALS)  # fmt: skip


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-style"])
def test_a_replys_first_token_that_starts_with_the_templates_space_is_trained(kind):
    tokenizer = trained_tokenizer(kind)
    tokenizer.chat_template = SPACE_BEFORE_REPLY
    [(ids, trained)] = encode_chats([TOOL_CHAT], tokenizer, True)
    text = tokenizer.apply_chat_template(TOOL_CHAT, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False)
    reply = text.rindex("It is sunny.")
    first = encoding.char_to_token(reply)
    assert encoding.token_to_chars(first)[0] == reply - 1  # the token begins with the template's space
    assert trained[first] and not trained[first - 1]  # ... and is the reply's; [/TOOL_RESULTS] is not
    assert all(trained[first : len(ids)])  # every reply token through </s>
    assert tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]).endswith("It is sunny.</s>")


def test_hermes_function_calling_data_renders_one_schema_block_and_one_result_wrapper(base_tokenizer, tmp_path):
    """NousResearch/hermes-function-calling-v1's shape: ShareGPT turns whose system text lists the tools in a
    <tools> block, the same schemas again in a `tools` column, tool results already wrapped in <tool_response>.
    With `columns: {tools: null}` (the recipe's) the template adds no second schema block, and a result wrapped
    in the data is not wrapped again by a template that wraps results itself: the model sees what it will at
    inference."""
    from finetune.config import SourceConfig
    from finetune.data.sources import load_source

    tokenizer = family_tokenizer(base_tokenizer, "tools")
    schema = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    conversation = [
        {"from": "system", "value": f"You may call functions. <tools> {json.dumps(schema)} </tools>"},
        {"from": "human", "value": "Weather in Paris?"}, {"from": "gpt", "value": call},
        {"from": "tool", "value": '<tool_response>\n{"sky": "sunny"}\n</tool_response>'},
        {"from": "gpt", "value": "It is sunny."},
    ]  # fmt: skip
    path = tmp_path / "hermes.jsonl"
    path.write_text(json.dumps({"id": "a", "conversations": conversation, "tools": json.dumps([schema])}) + "\n")
    texts = {}
    for name, columns in {"as_is": {"messages": "conversations"},
                          "recipe": {"messages": "conversations", "tools": None}}.items():  # fmt: skip
        data = load_source(SourceConfig(path=str(path), columns=columns))
        tools = data["tools"] if "tools" in data.column_names else None
        ((ids, trained),) = encode_chats(data["messages"], tokenizer, True, tools=tools)
        texts[name] = tokenizer.decode(ids)
        assert tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]).endswith("It is sunny.<|im_end|>")
    assert texts["as_is"].count("get_weather") == 3  # the system text's schema, the template's, the call
    assert texts["recipe"].count("get_weather") == 2 and "# Tools" not in texts["recipe"]
    for text in texts.values():
        assert text.count("<tool_response>") == 1 and '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in text


def test_reasoning_in_either_field_is_written_where_the_template_reads_it_and_trained(base_tokenizer):
    """gpt-oss's data gives reasoning as `thinking`, Qwen3's as `reasoning_content`: either trains on either
    template, where it reads its own field. Harmony writes the last reply's on an analysis channel before its
    final one: trained from the channel that follows the generation prompt through <|return|>, as the model
    generates it (the reasoning's text kept as context only with train_on_reasoning=false); earlier replies'
    reasoning is dropped as the template drops it. A template that reads neither field gets a <think> block,
    even one that names `thinking` for something else (a switch)."""
    question = turns(("system", "Be brief."), ("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "and 3 4"))
    harmony = family_tokenizer(base_tokenizer, "gpt-oss")
    for field in ("thinking", "reasoning_content"):
        messages = [*question[:2], {**question[2], field: "drop me"}, question[3],
                    {"role": "assistant", "content": "4 3", field: "swap them"}]  # fmt: skip
        [(ids, trained)] = encode_chats([messages], harmony, True)
        text = harmony.decode(ids)
        assert "drop me" not in text and "<|channel|>analysis<|message|>swap them<|end|>" in text
        assert harmony.decode([i for i, t in zip(ids, trained, strict=True) if t]) == (
            "<|channel|>final<|message|>2 1<|end|>"
            "<|channel|>analysis<|message|>swap them<|end|><|start|>assistant<|channel|>final<|message|>4 3<|return|>"
        )
    cfg = DataConfig(train_path="x", max_length=256, packing=False, train_on_reasoning=False)
    rows, stats = prepare_split(datasets.Dataset.from_list([{"messages": messages}]), harmony, cfg, 0)
    trained = harmony.decode([t for t in rows[0]["target_ids"] if t != IGNORE])
    assert "swap" not in trained and trained.endswith(
        "<|end|><|start|>assistant<|channel|>final<|message|>4 3<|return|>"
    )
    assert stats.num_reasoning_tokens == len(harmony("swap them", add_special_tokens=False)["input_ids"])
    think = turns(("user", "reverse: 1 2"), ("assistant", "<think>swap them</think>2 1"))  # a think block: the same
    given = [think[0], {"role": "assistant", "content": "2 1", "thinking": "swap them"}]
    assert encoded_trained(harmony, think) == trained_and_ids(harmony, given)[0]
    qwen3 = family_tokenizer(base_tokenizer, "qwen-3")
    assert (
        trained_and_ids(qwen3, think)[0]
        == encoded_trained(qwen3, given)
        == ("<think>\nswap them\n</think>\n\n2 1<|im_end|>")
    )
    switch = family_tokenizer(base_tokenizer, "qwen-2.5")
    switch.chat_template = "{%- if enable_thinking is defined %}{% endif %}" + switch.chat_template
    assert encoded_trained(switch, given) == "<think>\nswap them\n</think>\n\n2 1<|im_end|>"
    both = [think[0], {**given[1], "reasoning_content": "swap"}]
    with pytest.raises(FinetuneError, match="sample 0, message 1 has both reasoning_content and thinking"):
        encode_chats([both], harmony, True)


def encoded_trained(tokenizer, messages: list[dict]) -> str:
    [(ids, trained)] = encode_chats([messages], tokenizer, True)
    return tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t])


# Templates of 2025-26 models' behaviours (#37), small ones written here. The rule they check: an assistant turn
# is trained from the end of its header (what the template writes for a generation prompt, less a think tag the
# prompt forces) through its end-of-turn marker, tool calls with their wrappers, an empty think block included.

# QwQ's and DeepSeek-R1's: the generation prompt opens the reasoning (`<think>\n`), which a turn of tool calls or an
# earlier reply does not have; calls written with Qwen's wrappers, several per turn, after the turn's words.
FORCED_THINK_TOOLS = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}
{%- set c = m.content or '' %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}
{{- c }}
{%- for tc in m.tool_calls or [] %}{% set f = tc.function %}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{% endif %}"""

# GLM-4.7's and DeepSeek-V3.2's: earlier replies keep a bare `</think>` where their reasoning was, the last one
# its reasoning; the generation prompt opens the reasoning.
BARE_THINK_CLOSE = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}{% set c = m.content %}
{%- set r = m.reasoning_content if m.reasoning_content is defined else '' %}
{%- if '</think>' in c %}{% set r = c.split('</think>')[0].split('<think>')[-1] %}
{%- set c = c.split('</think>')[-1] %}{% endif %}
{{- '<|assistant|>' }}{% if loop.last %}{{- '<think>' + r + '</think>' }}{% else %}{{- '</think>' }}{% endif %}
{{- c + '<|end|>' }}
{%- else %}{{- '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|><think>' }}{% endif %}"""

# Nemotron-3's: earlier replies keep an empty think block.
EMPTY_THINK_BLOCK = BARE_THINK_CLOSE.replace("{{- '</think>' }}", "{{- '<think></think>' }}")

# gpt-oss's harmony and gemma-4's: a tool result's header names the call it answers.
NAMED_RESULTS = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}{{- '<|turn|>model\n' + (m.content or '') }}
{%- for tc in m.tool_calls or [] %}
{{- '<|tool_call|>call:' + tc.function.name + (tc.function.arguments | tojson) + '<|/tool_call|>' }}
{%- endfor %}{{- '<|end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|turn|>tool\n' + messages[loop.index0 - 1].tool_calls[0].function.name + ': ' + m.content + '<|end|>\n' }}
{%- else %}{{- '<|turn|>' + m.role + '\n' + m.content + '<|end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|turn|>model\n' }}{% endif %}"""

# Llama-3.3's, Mistral-Small's, Hermes-3's: a turn of tool calls is written as its calls alone, its text dropped.
DROPS_CALL_TEXT = r"""{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + (m.tool_calls[0].function | tojson) + '<|eot_id|>' }}
{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

# Keeps only what follows an earlier turn's `</think>`, and a newline before the calls only when that is not empty (as
# NVIDIA's Nemotron-Nano-v2 does): a turn of calls whose content is a think block renders as if it had none.
STRIPS_CALL_THINK = r"""{%- for m in messages %}
{%- set content = m.content.split('</think>')[-1] if m.content else '' %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + content }}
{%- if m.tool_calls %}{{- ('\n' if content else '') + (m.tool_calls[0].function | tojson) }}{% endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""


def template_tokenizer(base_tokenizer, template: str, eos: str, specials: list[str]):
    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer.name_or_path)
    tokenizer.add_special_tokens({"eos_token": eos, "additional_special_tokens": specials})
    tokenizer.chat_template = template
    return tokenizer


CALL_2 = {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}
AGENT_CHAT = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, CALL_2]},  # words, then parallel calls
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "tool", "content": '{"time": "9:00"}'},
    {"role": "assistant", "tool_calls": [CALL]},  # a call alone, in a later turn
    {"role": "tool", "content": '{"sky": "still sunny"}'},
    {"role": "assistant", "content": " Sunny, 9:00 — très beau."},  # a leading space, unicode
]
WRAPPED = '<tool_call>\n{{"name": "{}", "arguments": {{"city": "Paris"}}}}\n</tool_call>'


def test_a_turn_of_tool_calls_is_trained_with_its_wrappers_under_a_prompt_that_opens_reasoning(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, FORCED_THINK_TOOLS, "<|im_end|>", ["<|im_start|>", "<think>"])
    trained, _, _ = trained_and_ids(tokenizer, AGENT_CHAT)
    assert trained == (
        "Let me look." + WRAPPED.format("get_weather") + WRAPPED.format("get_time") + "<|im_end|>"
        + WRAPPED.format("get_weather") + "<|im_end|>" + " Sunny, 9:00 — très beau.<|im_end|>"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("template", "earlier"), [(BARE_THINK_CLOSE, "</think>"), (EMPTY_THINK_BLOCK, "<think></think>")]
)
def test_what_a_template_writes_into_an_earlier_reply_for_its_thinking_is_trained_with_it(
    base_tokenizer, template, earlier
):
    tokenizer = template_tokenizer(base_tokenizer, template, "<|end|>", ["<|user|>", "<|assistant|>", "<think>",
                                                                          "</think>"])  # fmt: skip
    messages = turns(("user", "reverse: 1 2"), ("assistant", "<think>swap</think>2 1"), ("user", "and 3 4"),
                     ("assistant", "<think>swap again</think>4 3"))  # fmt: skip
    trained, _, text = trained_and_ids(tokenizer, messages)
    assert f"<|assistant|>{earlier}2 1<|end|>" in text
    # After the prompt `<|assistant|><think>` the model writes `</think>` to end an empty reasoning: trained.
    assert trained == "</think>2 1<|end|>swap again</think>4 3<|end|>"


def test_a_tool_result_that_names_its_call_leaves_the_call_located(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, NAMED_RESULTS, "<|end|>", ["<|turn|>", "<|tool_call|>",
                                                                              "<|/tool_call|>"])  # fmt: skip
    trained, _, text = trained_and_ids(tokenizer, TOOL_CHAT)
    assert "<|turn|>tool\nget_weather: " in text
    assert trained == '<|tool_call|>call:get_weather{"city": "Paris"}<|/tool_call|><|end|>It is sunny.<|end|>'


@pytest.mark.parametrize("template", [DROPS_CALL_TEXT, STRIPS_CALL_THINK], ids=["writes-calls-only", "strips-think"])
def test_text_a_template_drops_from_a_turn_of_tool_calls_is_refused_naming_why(base_tokenizer, template):
    tokenizer = template_tokenizer(base_tokenizer, template, "<|eot_id|>", ["<|start_header_id|>",
                                                                            "<|end_header_id|>"])  # fmt: skip
    assert trained_and_ids(tokenizer, TOOL_CHAT)[0] == (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}<|eot_id|>It is sunny.<|eot_id|>'
    )
    thinking = [TOOL_CHAT[0], {**TOOL_CHAT[1], "content": "<think>Paris is a city.</think>"}, *TOOL_CHAT[2:]]
    with pytest.raises(FinetuneError, match="sample 0, message 1: the chat template writes no text for an assistant"):
        encode_chats([thinking], tokenizer, True)


def test_finetune_check_tries_the_template_on_agent_and_reasoning_shapes(base_tokenizer):
    from finetune.data.chat import probe_template

    located = probe_template(template_tokenizer(base_tokenizer, FORCED_THINK_TOOLS, "<|im_end|>", ["<|im_start|>"]))
    assert located == (
        "chat template: replies located exactly in multi-turn replies with reasoning, in a tool call with reasoning "
        "beside it, its result and an answer, in parallel tool calls, their results and an answer"
    )
    drops = probe_template(template_tokenizer(base_tokenizer, DROPS_CALL_TEXT, "<|eot_id|>", ["<|end_header_id|>"]))
    assert "cannot train a tool call with reasoning beside it, its result and an answer (its probe, message 1: the " \
        "chat template writes no text for an assistant turn that makes tool calls" in drops  # fmt: skip
    summarized = probe_template(family_tokenizer(base_tokenizer, "last-reply-only"))
    assert summarized.startswith("chat template: cannot train multi-turn replies with reasoning (its probe: the ")


def test_a_template_that_renders_only_with_tools_is_learned_with_a_probe_tool(base_tokenizer):
    """Hermes-3's and Command-R's tool-use templates raise on a conversation without tools: their layout (header,
    end marker) is learned with a probe tool, so replies still train through their end marker."""
    tokenizer = family_tokenizer(base_tokenizer, "tools")
    tokenizer.chat_template = (
        "{%- if not tools %}{{ raise_exception('this template renders conversations with tools only') }}{% endif %}"
        + TOOLS
    )
    [(ids, trained)] = encode_chats([TOOL_CHAT], tokenizer, True, tools=[json.dumps([WEATHER])])
    assert tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "It is sunny.<|im_end|>"
    )


# Command-R7B's tool-use layout: rendered only with tools, a reply wrapped in <|START_RESPONSE|> ... <|END_RESPONSE|>
# and its turn closed by one more token.
RESPONSE_WRAPPED = r"""{%- if not tools %}{{ raise_exception('this template renders conversations with tools only') }}
{%- endif %}
{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Tools: ' + (tools | map(attribute='function') | map(attribute='name')
    | join(', ')) + '<|END_OF_TURN_TOKEN|>' }}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>' + m.content
    + '<|END_RESPONSE|><|END_OF_TURN_TOKEN|>' }}
{%- else %}{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + m.content + '<|END_OF_TURN_TOKEN|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"""


def test_a_turn_closed_by_two_tokens_trains_both_and_its_opening(base_tokenizer):
    specials = ["<|START_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                "<|START_RESPONSE|>", "<|END_RESPONSE|>"]  # fmt: skip
    tokenizer = template_tokenizer(base_tokenizer, RESPONSE_WRAPPED, "<|END_OF_TURN_TOKEN|>", specials)
    messages = turns(("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "and 3 4"), ("assistant", "4 3"))
    [(ids, trained)] = encode_chats([messages], tokenizer, True, tools=[json.dumps([WEATHER])])
    assert tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]) == (
        "<|START_RESPONSE|>2 1<|END_RESPONSE|><|END_OF_TURN_TOKEN|><|START_RESPONSE|>4 3<|END_RESPONSE|>"
        "<|END_OF_TURN_TOKEN|>"
    )


# DeepSeek-R1's: a turn is written as its text or, when it has none, as its calls (never both); after tool results,
# the template writes the results' closing token where a header would be, as the generation prompt there.
TEXT_OR_CALLS = r"""{{- bos_token }}{%- set ns = namespace(after_tool=false) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{% set ns.after_tool = false %}{{- '<｜User｜>' + m.content }}
{%- elif m.role == 'assistant' and not m.content %}{% set ns.after_tool = false %}
{{- '<｜Assistant｜><｜calls｜>' }}
{%- for tc in m.tool_calls %}{{- '<｜call｜>' + tc.function.name + '\n' + (tc.function.arguments | tojson) }}
{%- endfor %}
{{- '<｜/calls｜><｜end｜>' }}
{%- elif m.role == 'assistant' %}{% set c = m.content %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}
{%- endif %}
{%- if ns.after_tool %}{{- '<｜/outputs｜>' + c + '<｜end｜>' }}{% set ns.after_tool = false %}
{%- else %}{{- '<｜Assistant｜>' + c + '<｜end｜>' }}{% endif %}
{%- elif m.role == 'tool' %}{% if not ns.after_tool %}{{- '<｜outputs｜>' }}{% endif %}{% set ns.after_tool = true %}
{{- '<｜output｜>' + m.content }}
{%- endif %}
{%- endfor %}
{%- if ns.after_tool %}{{- '<｜/outputs｜>' }}{% endif %}
{%- if add_generation_prompt and not ns.after_tool %}{{- '<｜Assistant｜><think>\n' }}{% endif %}"""
TEXT_OR_CALLS_SPECIALS = ["<｜User｜>", "<｜Assistant｜>", "<｜calls｜>", "<｜call｜>", "<｜/calls｜>",
                          "<｜outputs｜>", "<｜output｜>", "<｜/outputs｜>", "<think>", "</think>"]  # fmt: skip
# The same, as DeepSeek-R1's and V3's are published: calls written for a content that `is none`, which transformers
# never passes (apply_chat_template leaves null keys out).
CALLS_FOR_NULL_CONTENT = TEXT_OR_CALLS.replace("not m.content", "m.content is none")
CALL_TURN = '<｜calls｜><｜call｜>get_weather\n{"city": "Paris"}<｜/calls｜><｜end｜>'


def test_a_turn_written_as_its_text_or_its_calls_trains_its_calls_and_refuses_text_beside_them(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, TEXT_OR_CALLS, "<｜end｜>", TEXT_OR_CALLS_SPECIALS)
    assert encoded_trained(tokenizer, TOOL_CHAT) == CALL_TURN + "It is sunny.<｜end｜>"
    # Reasoning on the turn of calls: the template writes its text and drops the calls (trained before as "\n\n"
    # and an end marker, the calls gone): refused, naming why.
    thinking = [TOOL_CHAT[0], {**TOOL_CHAT[1], "reasoning_content": "Paris is a city."}, *TOOL_CHAT[2:]]
    with pytest.raises(FinetuneError, match="sample 0, message 1: the chat template writes no tool calls for an "
                                            "assistant turn that has text"):  # fmt: skip
        encode_chats([thinking], tokenizer, True)


def test_a_template_that_writes_calls_only_for_a_null_content_is_refused_naming_why(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, CALLS_FOR_NULL_CONTENT, "<｜end｜>", TEXT_OR_CALLS_SPECIALS)
    with pytest.raises(FinetuneError, match=r"sample 0, message 1: .* only when its content is null .* tests "
                                            r"`not message.content` instead"):  # fmt: skip
        encode_chats([TOOL_CHAT], tokenizer, True)


def sentencepiece_style(template: str, eos: str, specials: list[str]):
    """A SentencePiece-style tokenizer ('▁' glued to the next word, as Llama 2's and Mistral's) trained here, with
    the template's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokens = ["<unk>", "<|bos|>", eos, *specials]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=tokens, initial_alphabet=list('{}":,_—é\n'))
    lines = ["Weather and time in Paris? Let me look.", 'get_weather get_time {"city": "Paris"} {"sky": "sunny"}',
             "It is sunny. Sunny, 9:00 — très beau. reverse: 1 2 and 3 4 swap again tool model user"]  # fmt: skip
    backend.train_from_iterator(lines * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token=eos,
                                        unk_token="<unk>", additional_special_tokens=specials)  # fmt: skip
    tokenizer.chat_template = template
    return tokenizer


def trained_characters(tokenizer, messages: list[dict], tools: list | None = None) -> str:
    """The characters of the trained tokens, read from the rendering by each token's offsets (a SentencePiece-style
    decoder would respell spaces)."""
    [(ids, trained)] = encode_chats([messages], tokenizer, True, tools=tools)
    text = tokenizer.apply_chat_template(messages, tools=json.loads(tools[0]) if tools else None, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == ids
    characters = set()  # as a set: byte-level BPE splits a character of several bytes over tokens of its own
    for (start, end), t in zip(encoding["offset_mapping"], trained, strict=True):
        characters.update(range(start, end) if t else ())
    return "".join(text[c] for c in sorted(characters))


# Each behaviour of #37, on a byte-level BPE and a SentencePiece-style tokenizer alike: template, end marker,
# special tokens, conversation, tools, and the characters trained.
BEHAVIOURS = {
    "wrappers under a prompt that opens reasoning": (
        FORCED_THINK_TOOLS, "<|im_end|>", ["<|im_start|>", "<think>"], AGENT_CHAT, None,
        "Let me look." + WRAPPED.format("get_weather") + WRAPPED.format("get_time") + "<|im_end|>"
        + WRAPPED.format("get_weather") + "<|im_end|>" + " Sunny, 9:00 — très beau.<|im_end|>",
    ),
    "a bare </think> in an earlier reply": (
        BARE_THINK_CLOSE, "<|end|>", ["<|user|>", "<|assistant|>", "<think>", "</think>"],
        turns(("user", "reverse: 1 2"), ("assistant", "<think>swap</think>2 1"), ("user", "and 3 4"),
              ("assistant", "<think>swap again</think>4 3")), None,
        "</think>2 1<|end|>swap again</think>4 3<|end|>",
    ),
    "a result that names its call": (
        NAMED_RESULTS, "<|end|>", ["<|turn|>", "<|tool_call|>", "<|/tool_call|>"], TOOL_CHAT, None,
        '<|tool_call|>call:get_weather{"city": "Paris"}<|/tool_call|><|end|>It is sunny.<|end|>',
    ),
    "a reply wrapped and closed by two tokens": (
        RESPONSE_WRAPPED, "<|END_OF_TURN_TOKEN|>", ["<|START_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
                                                    "<|CHATBOT_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
        turns(("user", "reverse: 1 2"), ("assistant", "2 1")), [json.dumps([WEATHER])],
        "<|START_RESPONSE|>2 1<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
    ),
    "a turn of text or calls": (
        TEXT_OR_CALLS, "<｜end｜>", TEXT_OR_CALLS_SPECIALS, TOOL_CHAT, None, CALL_TURN + "It is sunny.<｜end｜>",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-style"])
@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
def test_each_template_behaviour_trains_the_same_characters_on_either_kind_of_tokenizer(
    base_tokenizer, kind, behaviour
):
    template, eos, specials, messages, tools, expected = BEHAVIOURS[behaviour]
    if kind == "byte-level BPE":
        tokenizer = template_tokenizer(base_tokenizer, template, eos, specials)
    else:
        tokenizer = sentencepiece_style(template, eos, specials)
    assert trained_characters(tokenizer, messages, tools) == expected


# The behaviours of the vendors' 2025-26 templates (#50; ../shared/chat-templates holds the real ones), each in a
# small template of our own. One rule: a reply starts where its text stops following what the template writes to
# prompt it, and ends at the model's own end of turn.

# QwQ's non-thinking prompt opens and closes the reasoning (`<think>\n</think>`); a turn of calls opens with neither.
CLOSED_THINK_TOOLS = FORCED_THINK_TOOLS.replace("<think>\\n' }}{% endif %}", "<think>\\n</think>' }}{% endif %}")


def test_a_turn_of_calls_opens_with_less_than_a_prompt_that_closes_the_reasoning(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, CLOSED_THINK_TOOLS, "<|im_end|>", ["<|im_start|>", "<think>",
                                                                                      "</think>"])  # fmt: skip
    assert "<think>\n</think>" in tokenizer.apply_chat_template(
        TOOL_CHAT[:1], tokenize=False, add_generation_prompt=True
    )
    assert trained_and_ids(tokenizer, AGENT_CHAT)[0] == (
        "Let me look." + WRAPPED.format("get_weather") + WRAPPED.format("get_time") + "<|im_end|>"
        + WRAPPED.format("get_weather") + "<|im_end|>" + " Sunny, 9:00 — très beau.<|im_end|>"
    )  # fmt: skip


# Command-R7B's: a reply opens its own response (`<|START_RESPONSE|>`) and closes it and the turn; after the last
# message the template always writes the next turn's header, so what follows a reply is another turn's opening.
RESPONSE_THEN_HEADER = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}{{- '<|SOT|><|BOT|><|SR|>' + m.content + '<|ER|><|EOT|>' }}
{%- else %}{{- '<|SOT|><|' + m.role | upper + '|>' + m.content + '<|EOT|>' }}{% endif %}
{%- endfor %}{{- '<|SOT|><|BOT|>' }}"""


def test_a_reply_ends_at_the_models_end_of_turn_not_at_the_next_turns_opening(base_tokenizer):
    markers = ["<|SOT|>", "<|BOT|>", "<|SR|>", "<|ER|>", "<|USER|>"]
    tokenizer = template_tokenizer(base_tokenizer, RESPONSE_THEN_HEADER, "<|EOT|>", markers)
    messages = turns(("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "and 3 4"), ("assistant", "4 3"))
    assert trained_and_ids(tokenizer, messages)[0] == "<|SR|>2 1<|ER|><|EOT|><|SR|>4 3<|ER|><|EOT|>"


# gemma-4's: a turn ends with `<turn|>` and a newline, and the tokenizer holds the newline as a token of its own.
NEWLINE_AFTER_TURN = r"""{%- for m in messages %}
{{- '<|turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' + m.content + '<turn|>\n' }}
{%- endfor %}{% if add_generation_prompt %}{{- '<|turn>model\n' }}{% endif %}"""


def test_a_newline_token_after_the_end_of_turn_is_formatting_not_the_reply(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, NEWLINE_AFTER_TURN, "<eos>", ["<|turn>", "<turn|>"])
    tokenizer.add_tokens(["\n"])  # an added token that is white space: no marker
    messages = turns(("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "and 3 4"), ("assistant", "4 3"))
    assert trained_and_ids(tokenizer, messages)[0] == "2 1<turn|>4 3<turn|>"


# GLM's: no turn closes; each ends where the next opens, a reply at `<|user|>`, a turn of calls at `<|observation|>`
# (the tokens generation stops at), with its calls' arguments as tags.
OPEN_ENDED_TURNS = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}{{- '<|assistant|>\n' + (m.content or '') }}
{%- for tc in m.tool_calls or [] %}{{- '<tool_call>' + tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}{{- '<arg_key>' + k + '</arg_key><arg_value>' + v + '</arg_value>' }}
{%- endfor %}{{- '</tool_call>' }}{% endfor %}
{%- elif m.role == 'tool' %}{{- '<|observation|>\n' + m.content }}
{%- else %}{{- '<|' + m.role + '|>\n' + m.content }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}{{- '<|assistant|>\n' }}{% endif %}"""


def test_turns_that_end_where_the_next_opens_train_through_that_opening(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, OPEN_ENDED_TURNS, "<|endoftext|>", ["<|user|>", "<|assistant|>",
                                                                                       "<|observation|>"])  # fmt: skip
    chat = [*TOOL_CHAT, {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]
    assert trained_and_ids(tokenizer, chat)[0] == (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call><|observation|>"
        "It is sunny.<|user|>You are welcome."
    )


# gemma-4's: each call closes with `<tool_call|>`, the token its turn of calls ends at; parallel calls, one after
# another, and the results follow in the same turn.
CLOSED_CALLS = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- if not (loop.index0 > 0 and messages[loop.index0 - 1].role == 'tool') %}{{- '<|turn>model\n' }}{% endif %}
{%- for tc in m.tool_calls or [] %}{{- '<|tool_call>call:' + tc.function.name + (tc.function.arguments | tojson)
    + '<tool_call|>' }}{% endfor %}
{%- if m.content %}{{- m.content + '<turn|>\n' }}{% endif %}
{%- elif m.role == 'tool' %}{{- '<|tool_response>' + m.content + '<tool_response|>' }}
{%- else %}{{- '<|turn>' + m.role + '\n' + m.content + '<turn|>\n' }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}{{- '<|turn>model\n' }}{% endif %}"""


def test_a_turn_of_parallel_calls_that_each_close_ends_after_the_last(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, CLOSED_CALLS, "<eos>", ["<|turn>", "<turn|>", "<|tool_call>",
                                                                           "<tool_call|>", "<|tool_response>",
                                                                           "<tool_response|>"])  # fmt: skip
    chat = [AGENT_CHAT[0], {"role": "assistant", "tool_calls": [CALL, CALL_2]}, *AGENT_CHAT[2:4],
            {"role": "assistant", "content": "Sunny, at 9:00."}]  # fmt: skip
    assert trained_and_ids(tokenizer, chat)[0] == (
        '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|><|tool_call>call:get_time{"city": "Paris"}'
        "<tool_call|>Sunny, at 9:00.<turn|>"
    )


# DeepSeek-V3.2's: after the tool results the reply opens with no header of its own, writing `</think>` (an empty
# reasoning, which the model generates) before its text; DeepSeek-R1's writes an assistant tag before the results.
RESULTS_THEN_REPLY = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- if not (loop.index0 > 0 and messages[loop.index0 - 1].role == 'tool') %}{{- '<|Assistant|>' }}{% endif %}
{%- for tc in m.tool_calls or [] %}{{- '<|call|>' + tc.function.name + (tc.function.arguments | tojson) }}{% endfor %}
{%- if m.tool_calls %}{{- '<|eos|><|Assistant|>' }}{% else %}{{- '</think>' + m.content + '<|eos|>' }}{% endif %}
{%- elif m.role == 'tool' %}{{- '<|results|>' + m.content + '<|/results|>\n\n' }}
{%- else %}{{- '<|User|>' + m.content }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}{{- '<|Assistant|><think>' }}{% endif %}"""


def test_a_reply_after_a_tool_result_starts_where_the_text_stops_following_the_prompt(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, RESULTS_THEN_REPLY, "<|eos|>", ["<|Assistant|>", "<|User|>",
                                                                                   "<|call|>", "<|results|>",
                                                                                   "<|/results|>", "</think>",
                                                                                   "<think>"])  # fmt: skip
    trained, _, text = trained_and_ids(tokenizer, TOOL_CHAT)
    assert '<|eos|><|Assistant|><|results|>{"sky": "sunny"}<|/results|>\n\n</think>It is sunny.' in text
    assert trained == '<|call|>get_weather{"city": "Paris"}<|eos|></think>It is sunny.<|eos|>'


# Command-R+'s tool-use template: a turn of calls (an `Action:` block) is left unclosed, the next turn opening on it.
UNCLOSED_CALLS = r"""{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{{- '<|SOT|><|BOT|>Action: ' + (m.tool_calls[0].function | tojson) + '\n' }}
{%- elif m.role == 'assistant' %}{{- '<|SOT|><|BOT|>' + m.content + '<|EOT|>' }}
{%- else %}{{- '<|SOT|><|' + m.role | upper + '|>' + m.content + '<|EOT|>' }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}{{- '<|SOT|><|BOT|>' }}{% endif %}"""


def test_a_turn_of_calls_the_template_leaves_unclosed_ends_before_the_next_turn_opens(base_tokenizer):
    markers = ["<|SOT|>", "<|BOT|>", "<|USER|>", "<|TOOL|>"]
    tokenizer = template_tokenizer(base_tokenizer, UNCLOSED_CALLS, "<|EOT|>", markers)
    assert trained_and_ids(tokenizer, TOOL_CHAT)[0] == (
        'Action: {"name": "get_weather", "arguments": {"city": "Paris"}}\nIt is sunny.<|EOT|>'
    )


# DeepSeek-V3's: a call's arguments are written as the text they are given (concatenated, not serialized).
TEXT_ARGUMENTS = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}{{- '<|A|>' + (m.content or '') }}
{%- for tc in m.tool_calls or [] %}{{- '<|call|>' + tc.function.name + '\n' + tc.function.arguments }}{% endfor %}
{{- '<|end|>' }}{% else %}{{- '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}{{- '<|A|>' }}{% endif %}"""


def test_arguments_are_given_as_text_to_a_template_that_writes_them_as_given(base_tokenizer):
    tokenizer = template_tokenizer(base_tokenizer, TEXT_ARGUMENTS, "<|end|>", ["<|A|>", "<|user|>", "<|tool|>",
                                                                               "<|call|>"])  # fmt: skip
    as_text = json.loads(json.dumps(TOOL_CHAT))
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    expected = '<|call|>get_weather\n{"city": "Paris"}<|end|>It is sunny.<|end|>'
    assert trained_and_ids(tokenizer, as_text)[0] == expected
    assert encoded_trained(tokenizer, TOOL_CHAT) == expected  # an object, which the template cannot concatenate


def test_the_vendors_templates_in_shared_train_what_they_write(repo_root=None):
    """../shared/chat-templates: the vendors' own templates, with real tokenizers, judged by its check.py. The
    cases left (7 refused, each naming the text its template drops; 0 wrong) are said in the closing note."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "shared" / "chat-templates"
    if not (folder / "check.py").is_file():
        pytest.skip(f"{folder} is not here (the vendors' templates are kept beside the project, not in it)")
    result = subprocess.run([sys.executable, str(folder / "check.py")], capture_output=True, text=True, timeout=600)
    counts = re.search(r"(\d+)/(\d+) correct, (\d+) refused, (\d+) wrong", result.stdout)
    assert counts, result.stdout[-2000:] + result.stderr[-2000:]
    correct, total, refused, wrong = map(int, counts.groups())
    assert correct >= 369 and wrong == 0 and refused <= 7, result.stdout[-4000:]
    # Each refusal names what the template does (drops a turn's text), never only that replies cannot be located.
    refusals = [line for line in result.stdout.splitlines() if ": refused: " in line]
    assert all("writes no text" in line for line in refusals), "\n".join(refusals)
