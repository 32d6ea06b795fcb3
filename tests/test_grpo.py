"""Online RL (`rl:`): the losses and advantages against TRL's GRPOTrainer, seeded sampling, rewards and their
errors, and real runs: 1 process vs 2 (the same completions and weights), resumed between rollouts."""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import types

import pytest
import torch
from helpers import GRPO_RECIPE, LaunchedRun, launch, tiny_config
from safetensors.torch import load_file

from finetune.config import RewardConfig, RLConfig, load_recipe
from finetune.errors import FinetuneError
from finetune.objectives.advantages import advantages
from finetune.objectives.grpo import GRPO
from finetune.objectives.policy_loss import summed_loss, token_losses
from finetune.rollouts.rewards import build_rewards, check_columns, score

# ---- The loss and advantages, against TRL's GRPOTrainer on the same log-probabilities, rewards and masks.


def _trl_loss(loss: str, beta: float, logps, old, ref, advantage, mask, max_new_tokens: int):
    """TRL's `GRPOTrainer._compute_loss` itself, on one process without accumulation, fed these log-probabilities."""
    from trl import GRPOTrainer

    accelerator = types.SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                                        gather_for_metrics=lambda t: t, sync_gradients=True)  # fmt: skip
    # GSPO is TRL's grpo loss with sequence-level ratios; its cispo bound is the weight's maximum (1 + ours).
    level = "sequence" if loss == "gspo" else "token"
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type="grpo" if loss == "gspo" else loss, epsilon_low=0.2,
        epsilon_high=1.28 if loss == "cispo" else 0.28, use_vllm=False, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_new_tokens, accelerator=accelerator,
        _metrics={"train": collections.defaultdict(list)},
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(mask.shape[0], 1, dtype=torch.long), "prompt_mask": torch.ones(mask.shape[0], 1),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask,
        "advantages": advantage, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_and_its_gradient_equal_trl_grpo_trainer(loss, beta):
    torch.manual_seed(0)
    rows, width, max_new_tokens = 6, 7, 9
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    completion = (torch.arange(width)[None] < lengths[:, None]).float()
    mask = completion.clone()
    mask[3] = 0  # a truncated completion masked (rl.mask_truncated): in TRL's mask, out of ours by token_mask
    logps = (-torch.rand(rows, width) * 3).requires_grad_()
    old = logps.detach() + torch.randn(rows, width) * 0.6  # a rollout trained on again: ratios away from 1
    ref = logps.detach() + torch.randn(rows, width) * 0.2
    advantage = torch.tensor([1.0, -1.2, 0.5, -0.3, 0.8, -0.9])
    expected = _trl_loss(loss, beta, logps, old, ref, advantage, mask, max_new_tokens)
    (expected_grad,) = torch.autograd.grad(expected, logps)

    epsilon = None if loss == "cispo" else 0.2  # cispo clips above only
    cfg = RLConfig(rewards=[RewardConfig(function="exact_match")], loss=loss, beta=beta, epsilon=epsilon,
                   epsilon_high=0.28, max_new_tokens=max_new_tokens)  # fmt: skip
    assert cfg.errors() == []
    kept = completion.bool()  # our tokens: the completions', rows flattened
    sequence = torch.arange(rows)[:, None].expand(rows, width)[kept]
    ours = token_losses(
        cfg, logps[kept], old[kept], ref[kept] if beta else None, advantage[sequence], mask[kept], sequence, rows
    )
    units = mask.sum() if cfg.per_token else torch.tensor(float(rows))  # the objective's count
    total = summed_loss(cfg, ours.per_token, mask[kept], sequence, rows) / units
    (grad,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-8)
    assert (ours.low_clipped | ours.high_clipped).any()  # the clip is exercised (both sides by the token losses)
    assert loss in ("gspo", "cispo") or ours.low_clipped.any() and ours.high_clipped.any()
    if loss == "gspo":  # one ratio per completion: a completion is clipped whole or not at all
        for n in range(rows):
            assert ours.high_clipped[sequence == n].unique().numel() == 1


def _trl_advantages(rewards_per_function, weights, generations, scale):
    """TRL's advantage computation (GRPOTrainer._generate_and_score_completions, sum_then_normalize), with its
    own `nanstd`: the steps in its order."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, generations), dim=1).repeat_interleave(generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, generations), dim=1).repeat_interleave(generations)
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + 1e-4)
    return torch.nan_to_num(advantage, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    torch.manual_seed(1)
    per_function = torch.rand(16, 2).round()
    per_function[0:4, 0] = 1.0  # a group whose rewards are all equal
    per_function[0:4, 1] = 0.0
    per_function[4:8, 0] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # a group whose rewards differ
    per_function[5, :] = math.nan  # unscored by every function: no reward, advantage 0
    per_function[6, 1] = math.nan  # unscored by one
    per_function[8:11, :] = math.nan  # a group with one scored completion: nothing to compare it with
    per_function[12:16, 0] = torch.tensor([0.0, 1.0, 1.0, 1.0])
    weights = torch.tensor([1.0, 0.5])

    def moments(values):  # one process: its own sums
        return values

    ours, _, no_signal = advantages(per_function, weights, 4, scale, moments)
    expected, _ = _trl_advantages(per_function, weights, 4, scale)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # Whatever divides the advantages, a group teaches nothing when its scored rewards are equal or fewer than two
    # (TRL counts the second kind as signal: its std is NaN, not 0).
    assert no_signal.view(4, 4)[:, 0].tolist() == [True, False, True, False]
    assert ours[5] == 0 and (scale == "batch" or (ours[:4] == 0).all()) and (ours[8:12] == 0).all()


# ---- Rewards: built-ins, functions of your own, and every way a reward can be wrong.


def good_reward(completions, answer, **kwargs):
    return [
        float(c[0]["content"] == a) if isinstance(c, list) else None for c, a in zip(completions, answer, strict=True)
    ]


def positional_reward(completions, /):
    return [0.0] * len(completions)


def short_reward(completions, **kwargs):
    return [1.0]


def nan_reward(completions, **kwargs):
    return [math.nan] * len(completions)


def test_rewards_built_in_and_imported():
    exact, boxed, form, own = build_rewards([
        RewardConfig(function="exact_match"),
        RewardConfig(function="exact_match", pattern=r"#### (\S+)", label="boxed"),
        RewardConfig(function="regex", pattern=r"\d( \d)*"), RewardConfig(function="test_grpo:good_reward", weight=2),
    ])  # fmt: skip
    assert own.name == "good_reward" and own.weight == 2 and boxed.name == "boxed"
    with pytest.raises(FinetuneError, match="give one a label of its own"):
        build_rewards([RewardConfig(function="exact_match"), RewardConfig(function="exact_match", column="x")])
    completions = [[{"role": "assistant", "content": "3 2 1"}], [{"role": "assistant", "content": "so #### 7"}]]
    scores = score([exact, boxed, form, own], ["p", "q"], completions, [[1], [2]], {"answer": ["3 2 1", "7"]})
    assert scores.tolist() == [[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]]
    unscored = score([own], ["p"], ["3 2 1"], [[1]], {"answer": ["3 2 1"]})
    assert math.isnan(unscored.item())  # None: not scored
    check_columns([exact, own], ["prompt", "answer"], "the data")
    with pytest.raises(FinetuneError, match="compares with column 'answer', which the data lacks"):
        check_columns([exact], ["prompt", "solution"], "the data")
    with pytest.raises(FinetuneError, match="good_reward requires answer, which the data lacks"):
        check_columns([own], ["prompt"], "the data")


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("no_such_module:reward", "rl.rewards=no_such_module:reward cannot be imported"),
        ("test_grpo:missing", "cannot be imported"),
        ("test_grpo:positional_reward", "a reward function is called with keyword arguments"),
        ("test_grpo:GRPO_RECIPE", "is not callable"),
    ],
)
def test_a_reward_that_cannot_be_called_is_refused_before_anything_loads(function, message):
    with pytest.raises(FinetuneError, match=message):
        build_rewards([RewardConfig(function=function)])


def float_reward(completions, **kwargs):
    return 0.5


def huge_reward(completions, **kwargs):
    return [1e39] * len(completions)


def numpy_reward(completions, **kwargs):
    import numpy

    return [numpy.float32(0.25), numpy.int64(1), torch.tensor(2.0), numpy.float64(0.5), True][: len(completions)]


def test_a_reward_returning_the_wrong_count_kind_or_size_is_refused_and_any_real_number_taken():
    (short,) = build_rewards([RewardConfig(function="test_grpo:short_reward")])
    with pytest.raises(FinetuneError, match="returned 1 values for 2 completions; return one float"):
        score([short], ["p", "q"], ["a", "b"], [[1], [2]], {})
    (nan,) = build_rewards([RewardConfig(function="test_grpo:nan_reward")])
    with pytest.raises(FinetuneError, match="returned float nan for completion 0; return a finite real number, or"):
        score([nan], ["p"], ["a"], [[1]], {})
    (bare,) = build_rewards([RewardConfig(function="test_grpo:float_reward")])
    with pytest.raises(FinetuneError, match=r"float_reward returned float 0.5, not a list; return a list of one"):
        score([bare], ["p"], ["a"], [[1]], {})
    (huge,) = build_rewards([RewardConfig(function="test_grpo:huge_reward")])
    with pytest.raises(FinetuneError, match=r"returned float 1e\+39 for completion 0; .* within float32 range"):
        score([huge], ["p"], ["a"], [[1]], {})
    (real,) = build_rewards([RewardConfig(function="test_grpo:numpy_reward")])  # TRL takes any real number
    scores = score([real], list("abcde"), list("abcde"), [[1]] * 5, {})
    assert scores[:, 0].tolist() == [0.25, 1.0, 2.0, 0.5, 1.0]


SEEN = {}


def seen_reward(prompts, completions, **kwargs):
    SEEN.update(prompts=prompts, completions=completions)
    return [1.0] * len(completions)


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def test_a_reward_that_scores_nothing_gives_no_signal_is_logged_absent_and_warned_once_a_window(capsys):
    """A function returning None for every completion: no group has two scored completions, so none carries signal;
    the window logs no reward (0 would read as one) and says why on one line."""
    from finetune.objectives.rollout_metrics import RolloutWindow

    (nothing,) = build_rewards([RewardConfig(function="test_grpo:none_reward")])
    per_function = score([nothing], ["p"] * 8, ["a"] * 8, [[1]] * 8, {})
    _, rewards, no_signal = advantages(per_function, torch.tensor([1.0]), 4, "group")
    assert no_signal.all()
    window = RolloutWindow(("none_reward",))
    window.add_rollout(rewards, per_function, [3] * 8, [False] * 8, no_signal, 4, 0.1)
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1, reduce=lambda t, _: t,
                                        print=print)  # fmt: skip
    values = window.metrics(accelerator, beta=0.0)
    assert "reward" not in values and "rewards/none_reward/mean" not in values and values["frac_reward_zero_std"] == 1
    printed = capsys.readouterr().out
    assert "warning: none of the 2 prompts since the last log had completions whose rewards differ" in printed
    assert "warning: rl.rewards: none_reward scored none of the 8 completions since the last log" in printed
    window.add_rollout(rewards, per_function, [16] * 8, [True] * 8, no_signal, 4, 0.1)
    window.metrics(accelerator, beta=0.0)
    assert "every completion since the last log (8) was cut at rl.max_new_tokens" in capsys.readouterr().out


def test_reward_settings_nothing_reads_are_refused():
    for reward, message in [
        ("{function: test_grpo:good_reward, pattern: 'x'}", "good_reward is a function of your own, and pattern"),
        ("{function: test_grpo:good_reward, column: solution}", "and column apply to the built-ins only"),
        ("{function: regex, pattern: 'x', column: answer}", "function=regex matches the completion against its"),
    ]:
        with pytest.raises(FinetuneError, match=message):
            load_recipe(GRPO_RECIPE, [f"rl.rewards=[{reward}]"])
    recipe = load_recipe(GRPO_RECIPE, ["rl.rewards=[{function: exact_match}]"])
    (exact,) = build_rewards(recipe.rl.rewards)
    assert exact.column == "answer"  # the default column, checked against the data as any
    with pytest.raises(FinetuneError, match="has a column named completions, as the argument every reward"):
        check_columns([exact], ["prompt", "answer", "completions"], "the data")
    # A null answer leaves the completion unscored (str(None) is no answer to compare with).
    assert math.isnan(score([exact], ["p"], ["None"], [[1]], {"answer": [None]}).item())


def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_syntax.py").write_text("def reward(completions, **kw):\n    return [1.0 for c in x\n")
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no API key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FinetuneError, match=r"importing broken_syntax failed with SyntaxError: .* line 2\); fix"):
        build_rewards([RewardConfig(function="broken_syntax:reward")])
    with pytest.raises(FinetuneError, match="importing raises_at_import failed with RuntimeError: no API key; fix"):
        build_rewards([RewardConfig(function="raises_at_import:reward")])


def test_data_settings_an_rl_run_cannot_honour_are_refused():
    for override in ("data.train_on_reasoning=false", "data.completion_only_loss=false", "data.multi_turn=last"):
        with pytest.raises(FinetuneError, match=f"{override} set how supervised replies train; an rl section"):
            load_recipe(GRPO_RECIPE, [override])


# ---- The recipe: settings a run cannot honour are refused at load.


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rl.num_generations=1"], "rl.num_generations must be >= 2"),
        (["data.packing=true"], "set data.packing=false"),
        (["rl.max_new_tokens=64"], "leaves no room for prompts after rl.max_new_tokens=64"),
        (["rl.num_iterations=2", "checkpoint.save_every_steps=3"], "must be a multiple of rl.num_iterations=2"),
        (["rl.rewards=[]"], "rl.rewards is empty"),
        (["rl.rewards=[{function: regex}]"], "function=regex needs a pattern"),
        (["rl.rewards=[{function: correct}]"], "neither a built-in"),
        (["preference.loss=dpo"], "remove the preference section"),
    ],
)
def test_rl_settings_a_run_cannot_honour_are_refused(overrides, message):
    with pytest.raises(FinetuneError, match=message):
        load_recipe(GRPO_RECIPE, overrides)


# ---- Sampling: a row's completion depends on its seed and the weights only, not on its batch.


def test_seeded_sampling_does_not_depend_on_the_batch(demo_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.rollouts.generation import Sampling, complete, generating, row_noise

    model = AutoModelForCausalLM.from_pretrained(demo_assets / "base", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    prompts = [tokenizer(f"<|user|>reverse: {' '.join('1234567'[:n])}<|end|><|assistant|>")["input_ids"] for n in
               range(1, 7)]  # fmt: skip
    seeds = [(5, 1, index, 0) for index in range(len(prompts))]
    with torch.no_grad(), generating(model):
        together = complete(model, prompts, tokenizer, accelerator, 12, Sampling(0.9, 0.95, row_noise(seeds, 12)))
        alone = [complete(model, [p], tokenizer, accelerator, 12, Sampling(0.9, 0.95, row_noise([s], 12)))[0]
                 for p, s in zip(prompts, seeds, strict=True)]  # fmt: skip
        reseeded = complete(model, prompts, tokenizer, accelerator, 12,
                            Sampling(0.9, 0.95, row_noise([(6, *s[1:]) for s in seeds], 12)))  # fmt: skip
        greedy = complete(model, prompts, tokenizer, accelerator, 12)
        greedy_alone = [complete(model, [p], tokenizer, accelerator, 12)[0] for p in prompts]
    assert together == alone and greedy == greedy_alone  # left padding changes nothing a row sees
    assert reseeded != together  # the seed is what decides
    # Three completions of each prompt, its forward run once for the three (`group`): what rows of their own sample.
    repeated = [p for p in prompts for _ in range(3)]
    sampling = Sampling(0.9, 0.95, row_noise([(5, 1, n // 3, n % 3) for n in range(len(repeated))], 12))
    with torch.no_grad(), generating(model):
        grouped = complete(model, repeated, tokenizer, accelerator, 12, sampling, group=3)
        apart = complete(model, repeated, tokenizer, accelerator, 12, sampling)
    assert grouped == apart and len({tuple(c) for c in grouped}) > len(prompts)  # the completions of a prompt vary


# ---- Shared rows: a prompt once, its completions after it, the same log-probabilities and gradients as a row each.


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("path", ["chunked", "full_logits"])
def test_shared_rows_train_what_separate_rows_train(model_type, path):
    from transformers import AutoModelForCausalLM

    from finetune.data.pack import with_host_indices
    from finetune.data.rollout import separate_rows, shared_rows
    from finetune.engine import shared_attention
    from finetune.objectives.loss import token_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="sdpa").double()
    shared_attention.register()
    model.set_attn_implementation(shared_attention.NAME)  # separate rows carry no grouping: SDPA as before
    lengths = [(5, [3, 1, 6]), (2, [4, 4, 2]), (9, [1, 7, 3])]  # prompts of 2 to 9 tokens, 3 completions each
    prompts, completions = [], []
    for prompt_length, completion_lengths in lengths:
        prompt = torch.randint(1, 128, (prompt_length,)).tolist()
        for length in completion_lengths:
            prompts.append(prompt)
            completions.append(torch.randint(1, 128, (length,)).tolist())
    weights = torch.randn(sum(len(c) for c in completions), dtype=torch.float64)
    results = []
    for rows in (separate_rows(prompts, completions, 0), shared_rows(prompts, completions, 3, 0)):
        model.zero_grad()
        logps = token_logps(model, with_host_indices(dict(rows)), path, temperature=0.7)
        (logps.double() * weights).sum().backward()
        results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (separate, separate_grads), (shared, shared_grads) = results
    assert shared.shape == (sum(len(c) for c in completions),)
    torch.testing.assert_close(shared, separate, rtol=1e-9, atol=1e-9)
    for name, grad in separate_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-5, atol=1e-6)  # logps in fp32
    shared_layout = shared_rows(prompts, completions, 3, 0)
    assert shared_layout["input_ids"].shape == (3, 9 + 8)  # the widest: a prompt of 9, completions of 1, 7, 3 less 1


@pytest.mark.parametrize("layer_checkpointing", [False, True])
def test_completions_attention_is_recomputed_once_in_backward(monkeypatch, layer_checkpointing):
    """The completions' attention is recomputed in backward, not kept (its gathered keys are completions x prompt
    long): two passes per layer, forward and backward; where the layers recompute their whole forward already
    (activation checkpointing), still two, not three."""
    from transformers import AutoModelForCausalLM

    from finetune.data.pack import with_host_indices
    from finetune.data.rollout import shared_rows
    from finetune.engine import shared_attention
    from finetune.objectives.loss import token_logps

    passes = []
    completions = shared_attention._completions
    monkeypatch.setattr(shared_attention, "_completions", lambda *a: passes.append(1) or completions(*a))
    torch.manual_seed(0)
    config = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    shared_attention.register()
    model.set_attn_implementation(shared_attention.NAME)
    if layer_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = with_host_indices(dict(shared_rows([[5, 6, 7]] * 4, [[8, 9, 10]] * 4, 2, 0)))
    with torch.no_grad():
        token_logps(model, rows, "chunked")
    assert len(passes) == config.num_hidden_layers  # nothing to recompute without gradients
    passes.clear()
    token_logps(model, rows, "chunked").sum().backward()
    assert len(passes) == 2 * config.num_hidden_layers


# ---- Real runs: GRPO from a partly trained demo model on 1 process and 2, and resumed elastically between
# rollouts. Each rollout is trained on twice (num_iterations), with a KL penalty to the base (a frozen copy).


def _grpo(
    tmp_path_factory, assets, base, name: str, processes: int, output_dir=None, config=None, **extra
) -> LaunchedRun:
    output_dir = output_dir or tmp_path_factory.mktemp(name) / "out"
    values = {
        "model.name_or_path": base, "data.train_path": assets / "data" / "prompts_train.jsonl",
        "data.eval_path": assets / "data" / "prompts_eval.jsonl", "output.dir": output_dir, "output.trackers": "[]",
        "train.max_steps": 4, "train.eval_every_steps": 4, "train.log_every_steps": 1, "optim.warmup_steps": 0,
        "train.global_batch_size": 8, "train.micro_batch_size": 4, "rl.num_generations": 6, "rl.num_iterations": 2,
        "rl.temperature": 0.5, "rl.beta": 0.04, "checkpoint.save_every_steps": 2, "eval.generate.samples": 20,
        "rl.dynamic_sampling_rounds": 2,
        **extra,
    }  # fmt: skip
    config = config or ("single_gpu.yaml" if processes == 1 else "fsdp2_full_shard.yaml")
    overrides = [f"{key}={value}" for key, value in values.items()]
    result = launch(config, overrides, num_processes=processes, recipe=GRPO_RECIPE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


@pytest.mark.multiprocess
def test_a_reward_that_fails_on_one_process_stops_every_process_with_its_message(tmp_path, demo_assets):
    """The others no longer wait in their next collective and end in a lost-peer traceback: every process raises
    the failing one's message, which rank 0 prints once."""
    (tmp_path / "one_sided.py").write_text(
        "import os\n\n\ndef reward(completions, **kwargs):\n"
        "    if os.environ['RANK'] == '1':\n        raise ValueError('the grader is down')\n"
        "    return [0.0] * len(completions)\n"
    )
    overrides = {
        "model.name_or_path": demo_assets / "base", "data.train_path": demo_assets / "data" / "prompts_train.jsonl",
        "data.eval_path": "null", "eval.generate": "null", "output.dir": tmp_path / "out", "output.trackers": "[]",
        "train.max_steps": 2, "train.global_batch_size": 4, "train.micro_batch_size": 2, "rl.num_generations": 2,
        "rl.max_new_tokens": 4,
        "rl.rewards": "[{function: one_sided:reward}]",
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = launch("fsdp2_full_shard.yaml", [f"{k}={v}" for k, v in overrides.items()], recipe=GRPO_RECIPE, env=env)
    assert result.returncode != 0
    assert (
        "finetune: error: rl.rewards: reward raised ValueError: the grader is down; fix the function"
        in (result.stderr)
        and "(on process 1)" in result.stderr
    ), result.stderr[-4000:]
    # What the launcher prints after (torch elastic's ChildFailedError) is outside finetune's processes.
    assert "finetune/" not in result.stderr and "[rank0]: Traceback" not in result.stderr, result.stderr[-4000:]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, demo_assets, partly_trained) -> tuple[LaunchedRun, LaunchedRun]:
    one = _grpo(tmp_path_factory, demo_assets, partly_trained, "grpo1", 1)
    # Two processes decode their rollouts over a static cache: the same completions as one process's dynamic one.
    two = _grpo(tmp_path_factory, demo_assets, partly_trained, "grpo2", 2, **{"rl.rollout_cache": "static"})
    return one, two


@pytest.mark.multiprocess
def test_grpo_samples_and_trains_the_same_on_one_process_and_two(grpo_runs):
    one, two = grpo_runs
    steps = one.per_step()
    assert sorted(steps) == [1, 2, 3, 4] and all("reward" in steps[s] for s in (1, 3))  # a rollout every 2 steps
    timed = [m for m in one.metrics() if "generation/seconds" in m]
    assert [m["step"] for m in timed] == [1, 3] and all(m["generation/tokens_per_second"] > 0 for m in timed)
    assert "reward" not in steps[2] and steps[2]["clip_ratio/region_mean"] >= 0  # step 2 trains on step 1's
    for step, values in two.per_step().items():  # the same completions, rewards and updates
        assert values == pytest.approx(steps[step], rel=1e-4, abs=1e-6), step
    assert 0 < steps[1]["reward"] < 1 and steps[1]["frac_reward_zero_std"] < 1  # rewards vary within groups
    # Dynamic sampling drew more prompts for groups whose rewards tied, the same on both process counts.
    assert steps[1]["dynamic_sampling/generated_per_trained"] > 1 and steps[1]["dynamic_sampling/dropped"] > 0
    assert steps[2]["kl"] > 0  # the policy has moved from its reference
    first, second = (load_file(run.output_dir / "final" / "model.safetensors") for run in grpo_runs)
    assert max((first[k] - second[k]).abs().max().item() for k in first) < 1e-5
    evaluated = [m for m in two.metrics() if "eval_reward" in m]
    assert evaluated and {"eval_rewards/exact_match", "eval_completions/mean_length", "eval_exact_match"} <= set(
        evaluated[0]
    )
    assert evaluated[0]["eval_completions/mean_length"] <= 16  # rl.max_new_tokens, not eval.generate's 24
    (one_evaluated,) = [m for m in one.metrics() if "eval_reward" in m]
    assert one_evaluated == pytest.approx(evaluated[0])  # every prompt once, on any process count
    assert "generation: parameters gathered once per rollout" in two.log
    assert "rollouts: a static KV cache, the decoding step eager (FSDP's hooks run in every forward" in two.log
    assert "rollouts: a dynamic KV cache" in one.log
    assert "(rl.beta > 0: the initial weights)" in two.log and "16 prompts per step" not in two.log
    assert "8 prompts per step" in two.log or "= 8 prompts" in two.log


@pytest.mark.multiprocess
def test_grpo_resumes_between_rollouts_on_another_process_count(grpo_runs, tmp_path_factory, demo_assets,
                                                                partly_trained):  # fmt: skip
    one, two = grpo_runs
    output_dir = tmp_path_factory.mktemp("grpo_resumed") / "out"
    shutil.copytree(two.output_dir / "checkpoints" / "step_2", output_dir / "checkpoints" / "step_2")
    resumed = _grpo(tmp_path_factory, demo_assets, partly_trained, "", 1, output_dir, "fsdp2_full_shard.yaml",
                    **{"checkpoint.resume": "auto"})  # fmt: skip
    expected = two.per_step()
    assert sorted(resumed.per_step()) == [3, 4]
    for step, values in resumed.per_step().items():
        assert values == pytest.approx(expected[step], rel=1e-4, abs=1e-6), step
    final, expected = (load_file(run.output_dir / "final" / "model.safetensors") for run in (resumed, two))
    assert max((final[k] - expected[k]).abs().max().item() for k in final) < 1e-5
    assert json.loads((output_dir / "checkpoints" / "step_4" / "trainer_state.json").read_text())["step"] == 4


@pytest.mark.multiprocess
def test_grpo_with_adapters_samples_as_the_base_at_first_and_exports(grpo_runs, tmp_path_factory, demo_assets,
                                                                     partly_trained):  # fmt: skip
    """LoRA under FSDP2, the KL penalty against the adapters switched off: at step 1 the adapters are zero, so the
    completions (and their rewards) are the full run's; the adapter and the merged model are exported. Its
    rollouts decode over a static cache (the adapter model's base forward, adapters inside)."""
    one, _ = grpo_runs
    lora = _grpo(
        tmp_path_factory, demo_assets, partly_trained, "grpo_lora", 2,
        **{"peft.r": 8, "peft.target_modules": "[all-linear]", "output.export_merged": "true", "train.max_steps": 2,
           "train.eval_every_steps": 2, "rl.rollout_cache": "static"},
    )  # fmt: skip
    rollout = ("reward", "reward_std", "completions/mean_length", "frac_reward_zero_std", "rewards/exact_match/mean")
    first = {name: one.per_step()[1][name] for name in rollout}
    assert {name: lora.per_step()[1][name] for name in rollout} == pytest.approx(first, rel=1e-5)
    assert lora.per_step()[2]["kl"] > 0
    assert (lora.output_dir / "final" / "adapter_config.json").exists()
    assert (lora.output_dir / "final_merged" / "model.safetensors").exists()


def test_prompts_are_tokenized_checked_and_kept_with_their_columns(demo_assets):
    import datasets
    from transformers import AutoTokenizer

    from finetune.config import DataConfig
    from finetune.data.prompt_only import PromptOnly

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    rewards = build_rewards([RewardConfig(function="exact_match")])
    samples = PromptOnly(8, lambda columns, where: check_columns(rewards, columns, where))
    long = "reverse: " + " ".join("1234567890" * 3)
    rows = [{"prompt": [{"role": "user", "content": "reverse: 1 2"}], "answer": "2 1"},
            {"prompt": [{"role": "user", "content": long}], "answer": "long"}]  # fmt: skip
    data = DataConfig(train_path="unused", max_length=24, packing=False)
    with pytest.raises(FinetuneError, match="1 prompts of the training data .* are longer than data.max_length - rl"):
        samples.prepare([(None, datasets.Dataset.from_list(rows))], tokenizer, data, seed=0)
    kept, stats = samples.prepare(
        [(None, datasets.Dataset.from_list(rows))], tokenizer, DataConfig(**{**vars(data), "truncation": "drop"}), 0
    )
    assert len(kept) == 1 and stats.num_too_long == 1 and "1 dropped as longer than the room" in stats.describe("x")
    rendered = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert kept[0]["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    batch = samples.collate(data, tokenizer)([kept[0]])
    assert batch["columns"] == {"prompt": [rows[0]["prompt"]], "answer": ["2 1"]} and batch[
        "prompt_index"
    ].tolist() == [0]
    with pytest.raises(FinetuneError, match="compares with column 'answer', which the training data lacks"):
        samples.prepare([(None, datasets.Dataset.from_list([{"prompt": "p", "solution": "s"}]))], tokenizer, data, 0)


def test_prompts_whose_answer_is_null_are_said_once_when_read(demo_assets):
    import datasets
    from transformers import AutoTokenizer

    from finetune.config import DataConfig
    from finetune.data.prompt_only import PromptOnly
    from finetune.rollouts.rewards import unscored

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    rewards = build_rewards([RewardConfig(function="exact_match", label="correct")])
    samples = PromptOnly(8, lambda columns, where: None, lambda prompts: unscored(rewards, prompts))
    rows = [{"prompt": "reverse: 1 2", "answer": "2 1"}, {"prompt": "reverse: 3 4", "answer": None},
            {"prompt": "reverse: 5 6", "answer": None}]  # fmt: skip
    _, stats = samples.prepare([(None, datasets.Dataset.from_list(rows))], tokenizer, DataConfig(
        train_path="unused", max_length=24, packing=False), 0)  # fmt: skip
    assert stats.describe("train").endswith("; 2 with a null answer, left unscored by correct")
    assert unscored(rewards, datasets.Dataset.from_list(rows[:1])) == []


def test_every_prompt_is_checked_when_read_and_a_prefill_is_continued(demo_assets, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    from finetune.config import DataConfig, SourceConfig
    from finetune.data.prompt_only import PromptOnly
    from finetune.data.sources import numbered

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    samples = PromptOnly(8, lambda columns, where: None)
    data = DataConfig(train_path="prompts.jsonl", max_length=48, packing=False)
    source = SourceConfig(path="prompts.jsonl")

    def prepare(rows, cfg=data):
        return samples.prepare([(source, numbered(datasets.Dataset.from_list(rows)))], tokenizer, cfg, seed=0)

    good = {"prompt": "reverse: 1 2", "answer": "2 1"}
    chat = {"prompt": [{"role": "user", "content": "reverse: 1 2"}], "answer": "2 1"}
    for rows, message in [
        ([good, {"prompt": "", "answer": "x"}], r"sample 1: the prompt is empty \(''\): there is nothing to answer"),
        ([chat, {"prompt": [], "answer": "x"}], "sample 1: messages must be a non-empty list"),
        ([chat, {"prompt": [{"role": None, "content": "hi"}], "answer": "x"}], "sample 1, message 0: expected an"),
        ([{"prompt": {"text": "p"}, "answer": "x"}], "sample 0: the prompt is dict .*; give each prompt as text or"),
        ([{"prompt": None, "answer": "x"}], "sample 0: the prompt is NoneType None; give each prompt as text or"),
    ]:
        with pytest.raises(FinetuneError, match=f"data.train_path prompts.jsonl: {message}"):
            prepare(rows)
    # data.invalid=drop: a bad prompt left out and counted, as supervised samples are; past 1%, the run stops.
    drop = DataConfig(**{**vars(data), "invalid": "drop"})
    kept, stats = prepare([good] * 150 + [{"prompt": "", "answer": "x"}] + [good] * 49, drop)
    assert len(kept) == stats.num_prompts == 199 and stats.num_invalid == 1
    first = "1 invalid dropped (first: data.train_path prompts.jsonl: sample 150: the prompt is empty"
    assert first in stats.describe("train")
    with pytest.raises(FinetuneError, match="3 of its 200 samples are invalid"):
        prepare([good] * 197 + [{"prompt": "", "answer": "x"}] * 3, drop)
    # A conversation that ends with the assistant's words is continued from them, as TRL does (no new turn).
    prefill = [{"role": "user", "content": "reverse: 1 2"}, {"role": "assistant", "content": "2"}]
    kept, _ = prepare([{"prompt": prefill, "answer": "2 1"}])
    text = tokenizer.decode(kept[0]["prompt_ids"])
    assert text.endswith("<|assistant|>2") and text.count("<|assistant|>") == 1
    # The reward sees the prefill as the start of the reply, and the prompt without it (TRL's bootstrap).
    objective = GRPO(RLConfig(rewards=[]), None, build_rewards([RewardConfig(function="test_grpo:seen_reward")]),
                     tokenizer, seed=0)  # fmt: skip
    batch = {"columns": {"prompt": [prefill], "answer": ["2 1"]}}
    objective._score([batch], [tokenizer(" 1<|end|>", add_special_tokens=False)["input_ids"]], repeats=1)
    assert SEEN["prompts"] == [prefill[:1]] and SEEN["completions"] == [[{"role": "assistant", "content": "2 1"}]]
    # A model without a chat template: conversations refused when read, naming the fix.
    plain = AutoTokenizer.from_pretrained(demo_assets / "base")
    plain.chat_template = None
    with pytest.raises(FinetuneError, match="holds conversations as prompts, and the tokenizer has no chat template"):
        samples.prepare([(source, datasets.Dataset.from_list([{"prompt": prefill[:1]}]))], plain, data, 0)
    with pytest.raises(FinetuneError, match="has no prompt column"):
        samples.prepare([(None, datasets.Dataset.from_list([{"question": "p", "answer": "s"}]))], tokenizer, data, 0)


def test_the_soft_overlong_penalty_equals_trl_and_its_settings_are_checked():
    from trl.rewards import get_soft_overlong_punishment

    (overlong,) = build_rewards([RewardConfig(function="overlong", cache=4)], max_new_tokens=10)
    ids = [[1] * n for n in range(12)]
    expected = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)(completion_ids=ids)
    assert overlong.function(completion_ids=ids, completions=[""] * 12) == pytest.approx(expected)
    assert overlong.function(completion_ids=ids, completions=[""] * 12)[5:] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    )
    for rewards, message in [
        ("[{function: overlong}]", "overlong needs cache >= 1"),
        ("[{function: overlong, cache: 17}]", "longer than rl.max_new_tokens=16"),
        ("[{function: exact_match, cache: 2}]", "cache is overlong's setting"),
        ("[{function: overlong, cache: 2, column: answer}]", "reads no column or pattern"),
    ]:
        with pytest.raises(FinetuneError, match=message):
            load_recipe(GRPO_RECIPE, [f"rl.rewards={rewards}"])


def test_dynamic_sampling_is_refused_without_room_and_warns_when_it_runs_out_of_rounds():
    from finetune.objectives.rollout_metrics import _warnings
    from finetune.run.build import max_steps_of

    recipe = load_recipe(GRPO_RECIPE, ["rl.dynamic_sampling_rounds=3"])
    assert max_steps_of(recipe, list(range(8)), 2) == recipe.train.max_steps  # 4 steps' prompts an epoch
    with pytest.raises(FinetuneError, match="may draw 4 steps' prompts for one step, and an epoch holds 3"):
        max_steps_of(recipe, list(range(6)), 2)
    with pytest.raises(FinetuneError, match="dynamic_sampling_rounds must be >= 0"):
        load_recipe(GRPO_RECIPE, ["rl.dynamic_sampling_rounds=-1"])
    (line,) = _warnings(completions=64, truncated=0, groups=8, no_signal=2, unfilled=3)
    assert line.startswith("dynamic sampling trained 3 groups without a reward spread since the last log")


def _decoding_case(demo_assets):
    """The demo's untrained model, 6 prompts x 4 completions, their noise; stop tokens it writes often, so that
    rows end at many different steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.rollouts.generation import Sampling, complete, generating, row_noise

    model = AutoModelForCausalLM.from_pretrained(demo_assets / "base", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    prompts = [tokenizer(f"<|user|>reverse: {' '.join('1234567'[:n])}<|end|><|assistant|>")["input_ids"] for n in
               range(1, 7)]  # fmt: skip
    repeated = [p for p in prompts for _ in range(4)]
    sampling = Sampling(1.0, 0.9, row_noise([(5, 1, n // 4, n % 4) for n in range(len(repeated))], 24))
    with torch.no_grad(), generating(model):
        written = complete(model, repeated, tokenizer, accelerator, 24, sampling, group=4, reference=True)
    common = collections.Counter(t for row in written for t in row).most_common(6)
    model.generation_config.eos_token_id = [token for token, _ in common[1:6]]
    return model, tokenizer, accelerator, repeated, sampling


def test_the_decoding_loop_writes_what_generate_writes_with_ended_rows_leaving(demo_assets):
    """`complete`'s own loop (rows that end leave the batch and the cache) against transformers' `generate` (the
    reference, which decodes every row to the end): the same tokens, greedy and sampled, grouped or not."""
    from finetune.rollouts.generation import complete, decodes_itself, generating

    model, tokenizer, accelerator, repeated, sampling = _decoding_case(demo_assets)
    with torch.no_grad(), generating(model):
        assert decodes_itself(model)
        for group, sampled in [(4, sampling), (1, sampling), (1, None)]:
            ours = complete(model, repeated, tokenizer, accelerator, 24, sampled, group=group)
            theirs = complete(model, repeated, tokenizer, accelerator, 24, sampled, group=group, reference=True)
            assert ours == theirs, (group, sampled is None)
            lengths = {len(c) for c in ours}
            assert sampled is None or len(lengths) > 3 and min(lengths) < 24  # rows ended at many steps


def test_the_static_cache_loop_writes_what_the_dynamic_one_writes_compiling_once_per_half(demo_assets):
    """`rl.rollout_cache: static` (finetune/rollouts/static_decode.py): the loop over a static cache, whose rows move
    to its first half, quarter... as rows end, writes the tokens of the dynamic loop, greedy and sampled, grouped or
    not; eagerly and with its step compiled (aot_eager here: the graphs inductor and CUDA graphs would take), one
    graph per half of the cache it ran on, none more for a second rollout of the same shape."""
    from torch._dynamo.utils import counters

    from finetune.rollouts.generation import complete, generating
    from finetune.rollouts.static_decode import StaticDecoding

    model, tokenizer, accelerator, repeated, sampling = _decoding_case(demo_assets)
    eager, compiled = StaticDecoding(None), StaticDecoding({"backend": "aot_eager"})
    with torch.no_grad(), generating(model):
        for group, sampled in [(4, sampling), (1, sampling), (1, None), (4, None)]:
            dynamic = complete(model, repeated, tokenizer, accelerator, 24, sampled, group=group)
            assert complete(model, repeated, tokenizer, accelerator, 24, sampled, group=group, static=eager) == dynamic
            graphs = counters["stats"]["unique_graphs"]
            assert complete(model, repeated, tokenizer, accelerator, 24, sampled, group=group, static=compiled) == (
                dynamic
            ), (group, sampled is None)
            halves = len(compiled._shape.steps)
            assert halves > 2 and counters["stats"]["unique_graphs"] - graphs <= halves
            lengths = {len(c) for c in dynamic}
            assert sampled is None or len(lengths) > 3 and min(lengths) < 24
        graphs = counters["stats"]["unique_graphs"]
        again = complete(model, repeated, tokenizer, accelerator, 24, sampling, group=4, static=compiled)
        assert again == complete(model, repeated, tokenizer, accelerator, 24, sampling, group=4)
        assert counters["stats"]["unique_graphs"] == graphs  # the same shape: its steps are kept
        # Another shape (fewer rows) gets caches and steps of its own, and the same tokens as the dynamic loop.
        assert complete(model, repeated[:6], tokenizer, accelerator, 24, sampling, group=1, static=compiled) == (
            complete(model, repeated[:6], tokenizer, accelerator, 24, sampling, group=1)
        )


def test_a_static_rollout_cache_decodes_a_model_without_grouped_heads_within_its_positions(demo_assets):
    """GPT-2's config names no key-value heads (as many as query heads), and a small one has 64 learned positions:
    the static cache allocates its heads and no slot past those positions, and writes the dynamic loop's tokens."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from finetune.rollouts.generation import complete, generating
    from finetune.rollouts.static_decode import StaticDecoding

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    prompts = [tokenizer(f"<|user|>reverse: {' '.join('1234567'[:n])}<|end|><|assistant|>")["input_ids"] for n in
               range(1, 5)]  # fmt: skip
    static = StaticDecoding(None)
    with torch.no_grad(), generating(model):
        dynamic = complete(model, prompts, tokenizer, accelerator, 16)
        assert complete(model, prompts, tokenizer, accelerator, 16, static=static) == dynamic
    assert static._shape.length == 64  # not the 256 the cache rounds up to elsewhere


def test_a_static_rollout_cache_is_refused_before_loading_for_layers_it_cannot_hold(tmp_path):
    """Sliding-window layers roll their cache's slots: `rl.rollout_cache: static` is refused when the objective is
    built (training's preflight), from the model's config alone; a plain model's passes."""
    from helpers import tiny_config

    from finetune.objectives import objective_for

    tiny_config("gemma2").to_json_file(tmp_path / "config.json")
    windowed = load_recipe(GRPO_RECIPE, ["rl.rollout_cache=static", f"model.config_file={tmp_path / 'config.json'}"])
    refused = r"rl.rollout_cache=static: .*\(sliding windows.*set rl.rollout_cache: dynamic"
    with pytest.raises(FinetuneError, match=refused):
        objective_for(windowed)
    tiny_config("llama").to_json_file(tmp_path / "config.json")
    assert objective_for(windowed).cfg.rollout_cache == "static"
