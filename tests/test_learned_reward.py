"""A reward model as an online RL reward (`rl.rewards: [{model: <folder>}]`): each episode rendered with the reward
model's own tokenizer and template (not the policy's) and scored as transformers' classifier scores that rendering;
the truncation rule (the start cut, never the end, and counted); folders that are not reward models and templates that
cannot render the episodes refused; the plan counts it; a real GRPO run on 2 processes with it sharded."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator
from helpers import LaunchedRun, launch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.config import ModelConfig, RewardConfig, load_recipe
from finetune.errors import FinetuneError
from finetune.model.loading import load_model
from finetune.objectives.learned_reward import learned_reward

TEMPLATE = "{% for m in messages %}{{ m['role'] }} says: {{ m['content'] }}\n{% endfor %}"
"""The reward model's own template: plain text, unlike the policy's special-token turns."""


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory, demo_assets):
    """A reward model of the demo's base (its head random, so scores differ), with a chat template of its own."""
    folder = tmp_path_factory.mktemp("learned") / "scorer"
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    base = ModelConfig(name_or_path=str(demo_assets / "base"))
    model = load_model(base, "none", score_pad_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def loaded(rm_folder, demo_assets, **settings):
    reward = learned_reward(RewardConfig(model=str(rm_folder), **settings))
    reward.load(ModelConfig(name_or_path=str(demo_assets / "base")), Accelerator(cpu=True), 2)
    return reward


def classifier_score(rm_folder, ids: list[int]) -> float:
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, 0].item()


PROMPTS = [[{"role": "user", "content": "reverse: 1 2 3"}], [{"role": "user", "content": "reverse: 4 5 6 7"}],
           [{"role": "user", "content": "reverse: 8 9"}]]  # fmt: skip
COMPLETIONS = [[{"role": "assistant", "content": "3 2 1"}], [{"role": "assistant", "content": "7 6 4 5"}],
               [{"role": "assistant", "content": "9 8"}]]  # fmt: skip


def test_each_episode_is_rendered_with_the_reward_models_template_and_scored_as_its_classifier_does(
    rm_folder, demo_assets
):
    reward = loaded(rm_folder, demo_assets)
    scores = reward(prompts=PROMPTS, completions=COMPLETIONS)  # 2 micro-batches: 2 renderings, then 1
    tokenizer = AutoTokenizer.from_pretrained(rm_folder)
    policy = AutoTokenizer.from_pretrained(demo_assets / "base")
    for prompt, completion, value in zip(PROMPTS, COMPLETIONS, scores, strict=True):
        ids = tokenizer.apply_chat_template([*prompt, *completion], tokenize=True)["input_ids"]
        assert ids != policy.apply_chat_template([*prompt, *completion], tokenize=True)["input_ids"]
        assert value == pytest.approx(classifier_score(rm_folder, ids), abs=1e-5)
    assert len(set(scores)) == 3 and reward.take_counts() == (0, 3)
    # Text prompts: the prompt's tokens, the completion's and EOS, as a reward model trained on text pairs reads them.
    [text] = reward(prompts=["reverse: 1 2"], completions=[" 2 1"])
    ids = tokenizer("reverse: 1 2")["input_ids"] + tokenizer(" 2 1", add_special_tokens=False)["input_ids"]
    assert text == pytest.approx(classifier_score(rm_folder, [*ids, tokenizer.eos_token_id]), abs=1e-5)


def test_a_rendering_longer_than_max_length_is_scored_on_its_end_and_counted(rm_folder, demo_assets):
    reward = loaded(rm_folder, demo_assets, max_length=8)
    scores = reward(prompts=PROMPTS, completions=COMPLETIONS)
    tokenizer = AutoTokenizer.from_pretrained(rm_folder)
    for prompt, completion, value in zip(PROMPTS, COMPLETIONS, scores, strict=True):
        ids = tokenizer.apply_chat_template([*prompt, *completion], tokenize=True)["input_ids"]
        assert len(ids) > 8 and value == pytest.approx(classifier_score(rm_folder, ids[-8:]), abs=1e-5)
    assert reward.take_counts() == (3, 3) and reward.take_counts() == (0, 0)


def test_a_template_that_cannot_render_the_episodes_is_refused_naming_the_fix(rm_folder, demo_assets, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(rm_folder)
    tokenizer.chat_template = "{{ raise_exception('no tool turns here') }}"
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((rm_folder / name).read_bytes())
    reward = loaded(tmp_path, demo_assets)
    with pytest.raises(FinetuneError, match="the reward model's chat template cannot render the episodes .*no tool"):
        reward(prompts=PROMPTS, completions=COMPLETIONS)


def test_a_folder_that_is_not_a_reward_model_is_refused_before_loading(demo_assets):
    with pytest.raises(FinetuneError, match="is a LlamaForCausalLM with .* labels, not a reward model"):
        learned_reward(RewardConfig(model=str(demo_assets / "base")))


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("{model: x, function: exact_match}", "each reward is a function or a model"),
        ("{model: x, column: answer}", "column applies to a function, not to a reward model"),
        ("{function: exact_match, max_length: 64}", "max_length applies to a reward model"),
        ("{model: x, micro_batch_size: 0}", "micro_batch_size must be >= 1"),
    ],
)
def test_reward_model_settings_that_cannot_apply_are_refused(reward, message):
    with pytest.raises(FinetuneError, match=message):
        load_recipe("recipes/demo/tiny_llama_grpo.yaml", [f"rl.rewards=[{reward}]"])


def test_the_plan_counts_the_reward_models_parameters(rm_folder, demo_assets):
    from finetune.plan.shape import recipe_shape

    recipe = load_recipe("recipes/demo/tiny_llama_grpo.yaml", [
        f"model.name_or_path={demo_assets / 'base'}", f"rl.rewards=[{{model: {rm_folder}}}]",
    ])  # fmt: skip
    scorer = AutoModelForSequenceClassification.from_pretrained(rm_folder)
    assert recipe_shape(recipe).reward_models == sum(p.numel() for p in scorer.parameters())


# ---- A real run: GRPO over 2 CPU processes, rewarded by the reward model (sharded) beside exact match.


@pytest.mark.multiprocess
def test_grpo_rewarded_by_a_sharded_reward_model_runs_and_logs_it(rm_folder, demo_assets, tmp_path):
    from helpers import REPO

    rewards = f"[{{model: {rm_folder}, label: learned, max_length: 24}}, {{function: exact_match, column: answer}}]"
    overrides = {
        "model.name_or_path": demo_assets / "base", "data.train_path": demo_assets / "data" / "prompts_train.jsonl",
        "data.eval_path": "null", "eval.generate": "null", "output.dir": tmp_path / "out", "output.trackers": "[]",
        "train.max_steps": 2, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.log_every_steps": 1,
        "rl.num_generations": 2, "rl.max_new_tokens": 6, "rl.rewards": rewards, "output.export": "false",
    }  # fmt: skip
    result = launch("fsdp2_full_shard.yaml", [f"{k}={v}" for k, v in overrides.items()],
                    recipe=REPO / "recipes" / "demo" / "tiny_llama_grpo_rm.yaml")  # make demo-rm's  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    run = LaunchedRun(result, tmp_path / "out")
    assert f"reward model: {rm_folder}, frozen, sharded as the policy over a 2 mesh (rl.rewards: learned)" in run.log
    steps = run.per_step()
    assert sorted(steps) == [1, 2]
    for values in steps.values():
        assert math.isfinite(values["rewards/learned/mean"]) and values["rewards/learned/std"] > 0
        # The demo's prompts render past 24 tokens in the reward model's template: each scored on its end, counted.
        assert values["rewards/learned/truncated"] == pytest.approx(1.0)
