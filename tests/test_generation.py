"""Evaluation by generation (`eval.generate`): held-out prompts answered by the model as it trains, scored the same
on any process count and layout."""

from __future__ import annotations

import datasets
import pytest
from helpers import DEMO_RECIPE, LaunchedRun, launch, recipe_overrides
from transformers import AutoTokenizer

from finetune.config import DataConfig, GenerateConfig, load_recipe
from finetune.data.prompts import generation_prompts
from finetune.data.sources import numbered
from finetune.errors import FinetuneError


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets / "base")


def test_prompts_are_conversations_up_to_their_last_reply_or_prompts_of_completions(tokenizer):
    chats = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "1 2 3"}, {"role": "assistant", "content": "3 2 1"}]},
        {"messages": [{"role": "user", "content": "4 5"}, {"role": "assistant", "content": "5 4"},
                      {"role": "user", "content": "6 7"}, {"role": "assistant", "content": "7 6"}]},
    ])  # fmt: skip
    data = DataConfig(train_path="unused", max_length=128)
    first, second = generation_prompts([chats], tokenizer, data, GenerateConfig(samples=5))
    assert first.reference == "3 2 1" and second.reference == "7 6"
    rendered = tokenizer.apply_chat_template(chats[1]["messages"][:3], tokenize=False, add_generation_prompt=True)
    assert second.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert "5 4" in tokenizer.decode(second.ids) and "7 6" not in tokenizer.decode(second.ids)
    pairs = datasets.Dataset.from_list([{"prompt": "reverse 1 2", "completion": "2 1", "answer": "21"}] * 3)
    (only,) = generation_prompts([pairs], tokenizer, data, GenerateConfig(samples=1, column="answer"))
    assert only.reference == "21" and only.ids == tokenizer("reverse 1 2")["input_ids"]
    with pytest.raises(FinetuneError, match="eval.generate.column=answr is not a column"):
        generation_prompts([pairs], tokenizer, data, GenerateConfig(column="answr"))
    pair = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": "1 2"}], "chosen": [{"role": "assistant", "content": "2 1"}],
         "rejected": [{"role": "assistant", "content": "1 2"}]},
    ])  # fmt: skip
    (preferred,) = generation_prompts([pair], tokenizer, data, GenerateConfig())
    rendered = tokenizer.apply_chat_template(pair[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert preferred.reference == "2 1" and preferred.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text = datasets.Dataset.from_list([{"text": "plain"}])
    with pytest.raises(FinetuneError, match="the eval data is plain text"):
        generation_prompts([text], tokenizer, data, GenerateConfig())


def test_samples_without_a_reference_are_refused_and_the_columns_named_are_the_datas(tokenizer):
    """An empty reference is in every completion (contains scored 100%) and a null one compared as "None"."""
    data = DataConfig(train_path="unused", max_length=128)
    rows = [{"prompt": "reverse 1 2", "answer": "2 1"}, {"prompt": "reverse 3 4", "answer": ""}]
    for metric in ("contains", "exact_match"):
        with pytest.raises(FinetuneError, match=r"eval sample 1 has no reference to score against \(answer is ''\)"):
            generation_prompts([numbered(datasets.Dataset.from_list(rows))], tokenizer, data,
                               GenerateConfig(column="answer", metric=metric))  # fmt: skip
    nulls = datasets.Dataset.from_list([rows[0], {"prompt": "reverse 5 6", "answer": None}])
    with pytest.raises(FinetuneError, match=r"eval sample 1 has no reference to score against \(answer is None\)"):
        generation_prompts([nulls], tokenizer, data, GenerateConfig(column="answer"))
    with pytest.raises(FinetuneError, match=r"is not a column of the eval data \(prompt, answer\); name one"):
        generation_prompts([numbered(nulls)], tokenizer, data, GenerateConfig(column="solution"))


def test_generation_needs_eval_data_and_prompts_of_its_own():
    with pytest.raises(FinetuneError, match="there is no eval data; set data.eval_path"):
        load_recipe(DEMO_RECIPE, ["data.eval_path=null", "eval.generate.samples=10"])
    with pytest.raises(FinetuneError, match="eval.generate.max_new_tokens must be >= 1"):
        load_recipe(DEMO_RECIPE, ["eval.generate.max_new_tokens=0"])


def test_generation_past_the_models_positions_is_refused_before_training(demo_assets, tmp_path):
    import types

    from finetune.data.prompts import Prompt
    from finetune.run.build import setup_generation

    overrides = recipe_overrides(demo_assets, tmp_path, **{"eval.generate.max_new_tokens": 250})
    recipe = load_recipe(DEMO_RECIPE, overrides)  # the demo model has 256 positions
    data = types.SimpleNamespace(prompts=[Prompt([1] * 4, "a"), Prompt([1] * 9, "b")])
    message = r"longest eval prompt \(9 tokens\) plus eval.generate.max_new_tokens=250 is more than the 256 positions"
    with pytest.raises(FinetuneError, match=message + r" of .*; lower max_new_tokens to 247 or less"):
        setup_generation(recipe, data, None)
    recipe.eval.generate.max_new_tokens = 247
    assert setup_generation(recipe, data, None).prompts == data.prompts


# ---- Real runs: a partly trained demo model answers 200 held-out lists on 1 process, 2, and 2 in a sequence group.


def _answers(tmp_path_factory, assets, base, name: str, config: str, processes: int, *launch_args: str) -> LaunchedRun:
    output_dir = tmp_path_factory.mktemp(name) / "out"
    overrides = recipe_overrides(
        assets, output_dir,
        **{
            "model.name_or_path": base, "train.max_steps": 2, "train.eval_every_steps": 2, "optim.lr": "1e-9",
            "train.micro_batch_size": 8 // (1 if launch_args else processes), "model.attn_implementation": "varlen",
            "eval.generate.samples": 200, "eval.generate.max_new_tokens": 24,
        },
    )  # fmt: skip
    run = LaunchedRun(launch(config, overrides, num_processes=processes, launch_args=launch_args), output_dir)
    assert run.result.returncode == 0, run.result.stdout[-3000:] + run.result.stderr[-6000:]
    return run


@pytest.mark.multiprocess
def test_generation_scores_the_same_on_one_process_two_and_a_sequence_group(
    tmp_path_factory, demo_assets, partly_trained
):
    runs = [
        _answers(tmp_path_factory, demo_assets, partly_trained, "one", "single_gpu.yaml", 1),
        _answers(tmp_path_factory, demo_assets, partly_trained, "two", "fsdp2_full_shard.yaml", 2),
        _answers(tmp_path_factory, demo_assets, partly_trained, "sp2", "sequence_parallel.yaml", 2,
                 "--parallelism_config_sp_size", "2", "--fsdp_cpu_ram_efficient_loading", "false"),
    ]  # fmt: skip
    scores = [[(m["eval_exact_match"], m["eval_completion_tokens"]) for m in r.metrics() if "eval_exact_match" in m]
              for r in runs]  # fmt: skip
    assert scores[0] == scores[1] == scores[2] and len(scores[0]) == 1
    match, tokens = scores[0][0]
    assert 0.0 < match < 1.0 and tokens > 1  # some lists reversed, some not: the metric is not vacuous
    assert f"step 2: exact match {round(match * 200)}/200 ({100 * match:.1f}%) by generation" in runs[1].log


# Run by test_static_cache_decoding_in_lock_step_writes_the_dynamic_loops_tokens on every process.
LOCK_STEP_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from finetune.engine.accelerator import build_accelerator
from finetune.rollouts.generation import Sampling, complete, generating, row_noise
from finetune.rollouts.static_decode import StaticDecoding

base, out = sys.argv[1], sys.argv[2]
accelerator = build_accelerator(trackers=[], project_dir=out, recipe_activation_checkpointing=False,
                                param_dtype=torch.float32)
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(base)
model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))  # FSDP2 shards both together
model.eval()
# Stop tokens the model writes often, so rows end at many steps; the processes' prompts differ, so they end apart.
model.generation_config.eos_token_id = json.loads(sys.argv[3])
rank = accelerator.process_index
prompts = [tokenizer(f"<|user|>reverse: {' '.join('1234567'[:n])}<|end|><|assistant|>")["input_ids"]
           for n in range(1 + 3 * rank, 4 + 3 * rank)]
rows = [p for p in prompts for _ in range(4)]
sampling = Sampling(1.0, 0.9, row_noise([(rank, n) for n in range(len(rows))], 24))
with torch.no_grad(), generating(model, gather_once=False) as lock_step:
    dynamic = complete(model, rows, tokenizer, accelerator, 24, sampling, lock_step, group=4)
    static = complete(model, rows, tokenizer, accelerator, 24, sampling, lock_step, group=4,
                      static=StaticDecoding(None))
# Gathered once, nothing waits: a compiled step, which dynamo cannot take whole through FSDP2's hooks: said, and
# decoded eagerly instead.
said = []
with torch.no_grad(), generating(model, gather_once=True):
    fallback = complete(model, rows, tokenizer, accelerator, 24, sampling, False, group=4,
                        static=StaticDecoding({"backend": "aot_eager"}, said.append))
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"lock_step": lock_step, "dynamic": dynamic, "static": static, "fallback": fallback, "said": said}, f)
"""


@pytest.mark.multiprocess
def test_static_cache_decoding_in_lock_step_writes_the_dynamic_loops_tokens(tmp_path, demo_assets):
    """FSDP2 on 2 processes gathering each layer at every forward (generation in lock-step): the static cache's
    loop, whose rows leave by halves while the processes' rows end at different steps (a process with none left
    decodes a filler row for the other's sake), writes the dynamic loop's tokens on each process. Asked to compile
    a step that FSDP2's hooks keep dynamo from taking whole, it says so once and decodes the same tokens eagerly."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_assets / "base", dtype=torch.float32)
    with torch.no_grad():  # the tokens the untrained model writes most, but the likeliest: rows end at many steps
        logits = model(input_ids=torch.arange(40).view(2, 20)).logits
    stops = logits.argmax(-1).flatten().unique()[:4].tolist()
    script = tmp_path / "lock_step.py"
    script.write_text(LOCK_STEP_SCRIPT)
    program = [str(script), str(demo_assets / "base"), str(tmp_path), json.dumps(stops)]
    result = launch("fsdp2_full_shard.yaml", [], program=program)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(run["lock_step"] for run in runs)
    for run in runs:
        assert run["static"] == run["dynamic"] == run["fallback"]
        (line,) = run["said"]
        assert line.startswith("warning: rl.rollout_cache=static: the decoding step could not be compiled (") and (
            line.endswith("it runs eagerly")
        )
    lengths = [sorted(len(c) for c in run["dynamic"]) for run in runs]
    assert lengths[0] != lengths[1] and any(min(length) < 24 for length in lengths)  # they ended apart
