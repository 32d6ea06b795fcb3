"""Agents (#64): tool calls read back from templates, episodes that train exactly what the model wrote, tools and
environments run with timeouts and counted errors, GRPO over episodes the same on 1 and 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, LaunchedRun, launch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig

from finetune.data.chat.tokens import encode_chats
from finetune.errors import FinetuneError
from finetune.rollouts.episodes import Agent, Episode, play
from finetune.rollouts.tool_calls import Call, tool_template
from finetune.rollouts.tools import EnvironmentFactory, load_tools, run_calls, tool_of

SHARED = Path(__file__).resolve().parents[2] / "shared" / "chat-templates"


def _vendor_tokenizers():
    """(name, tokenizer) of each vendor template in ../shared/chat-templates, loaded as its check.py loads them."""
    if not (SHARED / "check.py").is_file():
        pytest.skip(f"{SHARED} is not here (the vendors' templates are kept beside the project, not in it)")
    sys.path.insert(0, str(SHARED))
    argv, sys.argv = sys.argv, ["check.py", str(SHARED / "templates"), str(SHARED / "tokenizers")]
    try:  # it reads its folders from its command line when imported
        import check
    finally:
        sys.argv = argv

    for stem in check.MODELS:
        yield stem, check.load(stem)[0]


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "A city."},
    "hours": {"type": "integer", "description": "Hours ahead."}}, "required": ["city"]}}}  # fmt: skip
CALLS = [("weather", {"city": "Lyon", "hours": 6}), ("weather", {"city": "Oslo", "hours": 48})]


def _call_turn(calls: list[tuple[str, dict]]) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{n:05d}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for n, (name, arguments) in enumerate(calls, start=1)]}  # fmt: skip


def test_tool_calls_are_read_back_from_every_vendor_template_that_writes_them_as_json():
    """The format is learnt from each template's own rendering (no names); calls of a tool the probe never used
    are read back, name and arguments. Templates that write each argument apart, or no calls, are refused."""
    learnt, refused = [], []
    for stem, tokenizer in _vendor_tokenizers():
        try:
            template = tool_template(tokenizer)
        except FinetuneError as exc:
            refused.append((stem, str(exc)))
            continue
        learnt.append(stem)
        user = "\ue000ask\ue001"
        for count in (2, 1):  # two calls in a turn, or one where the template refuses two (Llama 3's)
            try:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": user}, _call_turn(CALLS[:count])], tools=[WEATHER], tokenize=False
                )
            except Exception:
                continue
            if "Oslo" in text or count == 1:
                break
        calls, unread = template.calls.read(text.split(user, 1)[1], [WEATHER])
        assert calls == [Call(name, arguments) for name, arguments in CALLS[:count]] and unread == 0, stem
        answer = template.results_text(calls, ["sunny"] * len(calls), [WEATHER])
        assert "sunny" in answer, stem
    assert len(learnt) >= 26, (learnt, refused)
    for stem, message in refused:  # one line each, saying what the template writes or lacks
        assert message.startswith("rl.tools: the chat template") and "\n" not in message, (stem, message)


class Replay(torch.nn.Module):
    """A "model" that replays a script: at each forward, certain of the token that follows the row's last position
    in `script` (the ids of a conversation as SFT encodes it), and of `stop` past its end (a template that closes no
    last reply). One row."""

    def __init__(self, script: list[int], vocab: int, stop: int):
        super().__init__()
        self.script, self.stop = script, stop
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, intermediate_size=8)  # fmt: skip
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, **_):
        following = int(position_ids[0, -1]) + 1
        logits = torch.full((1, 1, self.config.vocab_size), -1e9)
        logits[0, 0, self.script[following] if following < len(self.script) else self.stop] = 0.0
        return SimpleNamespace(logits=logits)


def _scripted_episode(tokenizer, conversation: list[dict], tools: list[dict], function) -> tuple[Episode, list, list]:
    """The conversation's first user turn played as an episode by a model replaying SFT's ids of the whole
    conversation, its tool answering as the conversation's tool message does; and SFT's ids and mask."""
    ((ids, trained),) = encode_chats([conversation], tokenizer, completion_only=True, tools=[tools])
    prompt = tokenizer.apply_chat_template(conversation[:1], tools=tools, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    template = tool_template(tokenizer)
    ends = [tokenizer.convert_tokens_to_ids(e) for e in template.ends if e in tokenizer.get_vocab()]
    agent = Agent(tokenizer, template, [], None, 4, 5.0, list({tokenizer.eos_token_id, *ends}))
    tool = tool_of(function, "test")
    episode = Episode(prompt_ids, {tool.name: tool}, tools)
    with torch.no_grad():
        replay = Replay(ids, len(tokenizer), agent.stops[0])
        play(replay, [episode], agent, tokenizer.pad_token_id or 0, 256, None, False, 1)
    return episode, ids[len(prompt_ids) :], trained[len(prompt_ids) :]


def weather(city: str, hours: int) -> str:
    """The weather in a city.

    Args:
        city: A city.
        hours: Hours ahead.
    """
    return "sunny and 22 degrees"


def test_a_scripted_episode_trains_exactly_the_ids_sft_trains(tmp_path):
    """The model replays a conversation's reply ids as SFT encodes them; the episode holds exactly those ids (the
    sampled ones, never decoded and re-encoded) and the tool's answer in between, and trains the positions SFT
    trains. On the demo's template exactly; on the vendors' templates wherever the template renders the history
    as the model saw it while acting (counted)."""
    from finetune.run import demo_agent

    demo_agent.build(str(tmp_path))
    conversation = [
        {"role": "user", "content": "What is the weather in Lyon in 6 hours?"},
        _call_turn(CALLS[:1]),
        {"role": "tool", "tool_call_id": "call00001", "name": "weather", "content": "sunny and 22 degrees"},
        {"role": "assistant", "content": "Sunny, 22 degrees."},
    ]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "agent" / "base")
    episode, ids, trained = _scripted_episode(tokenizer, conversation, [WEATHER], weather)
    assert episode.end == "answer" and episode.counts["calls"] == 1 and episode.counts["turns"] == 2
    assert _same(episode, ids, trained)
    assert episode.messages[-1] == {"role": "assistant", "content": "Sunny, 22 degrees."}
    same, differ = [], []
    for stem, vendor in _vendor_tokenizers():
        try:  # a template whose calls are not read, or that SFT refuses (it renders no tools): not compared
            episode, ids, trained = _scripted_episode(vendor, conversation, [WEATHER], weather)
        except FinetuneError:
            continue
        exact = _same(episode, ids, trained)
        (same if exact else differ).append(stem)
        # Where the episode differs from SFT's rendering, it is because the template renders the history otherwise
        # than the model read it while acting, which the log says once.
        assert exact or tool_template(vendor).history_difference() is not None, stem
    assert len(same) >= 13 and len(differ) <= 11, (same, differ)


def _same(episode: Episode, ids: list[int], trained: list[bool]) -> bool:
    """The episode holds SFT's ids and trains SFT's positions (what the template writes after the last reply's end,
    untrained, is not the episode's; a stop the model writes where the template closes no last reply is)."""
    end = len(episode.ids) - (len(episode.ids) == len(ids) + 1)
    ids_, wrote = episode.ids[:end], episode.wrote[:end]
    return ids_ == ids[:end] and wrote == [int(t) for t in trained[:end]] and not any(trained[end:])


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def broken(word: str) -> str:
    """Fail.

    Args:
        word: Anything.
    """
    raise RuntimeError("the index is down")


def opaque(word: str) -> object:
    """Return no text.

    Args:
        word: Anything.
    """
    return object()


def test_every_way_a_call_goes_wrong_is_the_result_the_model_reads_and_is_counted():
    tools = {t.name: t for t in (tool_of(f, "test") for f in (weather, slow, broken, opaque))}
    calls = [
        Call("weather", {"city": "Lyon", "hours": 1}), Call("missing", {}), Call("weather", None, "not JSON"),
        Call("weather", {"town": "Lyon"}), Call("broken", {"word": "x"}), Call("opaque", {"word": "x"}),
        Call("slow", {"seconds": 30}),
    ]  # fmt: skip
    began = time.monotonic()
    ((outcomes, took),) = run_calls([(calls, tools, 0.5)])
    assert time.monotonic() - began < 5 and took == 0.5  # the hanging call did not hold the run
    assert [o.error for o in outcomes] == [None, "unknown", "error", "error", "error", "error", "timeout"]
    assert outcomes[0].text == "sunny and 22 degrees"
    assert "no tool named 'missing'" in outcomes[1].text and "not JSON" in outcomes[2].text
    assert "TypeError" in outcomes[3].text and "RuntimeError: the index is down" in outcomes[4].text
    assert "returned object, not text" in outcomes[5].text and "within 0.5 seconds" in outcomes[6].text


def test_an_episode_s_calls_share_its_time_for_tools(tmp_path):
    """rl.episode_timeout: each call is given what the episode has left (at most rl.tool_timeout); once nothing is
    left, a call is answered with the timeout error at once, no tool run, and the episode goes on."""
    from finetune.run import demo_agent

    demo_agent.build(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "agent" / "base")
    tool = tool_of(slow, "test")
    agent = Agent(tokenizer, tool_template(tokenizer), [tool], None, 8, 0.6, [tokenizer.eos_token_id], 1.0)
    episode = Episode([tokenizer.bos_token_id], {tool.name: tool}, [tool.schema])
    call = '<|call|>{"name": "slow", "arguments": {"seconds": 30}}<|end|>'
    began = time.monotonic()
    for _ in range(3):
        episode.turn_start = len(episode.ids)
        episode.ids += tokenizer(call, add_special_tokens=False)["input_ids"]
        (answer,) = agent.answers([episode])
        assert answer and not episode.end  # the model reads the error and goes on
    assert time.monotonic() - began < 1.8  # 0.6 s, then the 0.4 s left, then no call run
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert "within 0.6 seconds" in results[0] and "within 0.4 seconds" in results[1], results
    assert "the episode's time for tools is spent" in results[2] and episode.counts["timeout"] == 3
    assert episode.tool_seconds == pytest.approx(1.0)
    from finetune.config import load_recipe

    refused = {
        AGENT_GRPO: ("rl.episode_timeout=0", "must be > 0 seconds"),
        REPO / "recipes" / "demo" / "tiny_llama_grpo.yaml": ("rl.episode_timeout=5", "this run makes none"),
    }
    for recipe, (override, message) in refused.items():
        with pytest.raises(FinetuneError, match=message):
            load_recipe(recipe, [override])


def test_tools_and_environments_a_run_cannot_use_are_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "agent_bad.py").write_text(
        "def undocumented(x):\n    return x\n\n\n"
        "class NoReset:\n    pass\n\n\n"
        "class Env:\n    def reset(self, **row):\n        return None\n\n"
        "    def weather(self, city: str) -> str:\n        '''W.\n\n        Args:\n"
        "            city: A city.\n        '''\n"
        "        return 'x'\n\n\n"
        "def failing():\n    raise OSError('no server')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        (lambda: load_tools(["agent_bad:undocumented"]), "has no JSON schema"),
        (lambda: load_tools(["agent_bad:nothing"]), "cannot be imported"),
        (lambda: EnvironmentFactory.load("agent_bad:NoReset", []), "has no reset method"),
        (lambda: EnvironmentFactory.load("agent_bad:failing", []), "raised OSError: no server"),
        (lambda: EnvironmentFactory.load("agent_bad:Env", load_tools(["tests.test_agents:weather"])), "two tools"),
    ]
    for attempt, message in cases:
        with pytest.raises(FinetuneError, match=message) as caught:
            attempt()
        assert "\n" not in str(caught.value)


def test_a_template_without_tool_calls_is_refused_naming_what_it_lacks(demo_assets):
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "base")  # the SFT demo's template renders no calls
    with pytest.raises(FinetuneError, match="the chat template writes no tool calls.*data.chat_template"):
        tool_template(tokenizer)


AGENT_SFT, AGENT_GRPO = (REPO / "recipes" / "demo" / f"agent_{name}.yaml" for name in ("sft", "grpo"))
ENVIRONMENT = '''
from finetune.run.demo_agent import lookup as stored


class Lists:
    """A shelf of lists: its one tool looks a list up; it rewards an episode that looked up the prompt's own."""

    def reset(self, prompt, answer, **row):
        self.key = prompt[-1]["content"].split(" ", 2)[2]
        self.found = False
        self.closed = False

    def lookup(self, key: str) -> str:
        """The list of digits stored under a key.

        Args:
            key: The list's key, its digits apart (for example "5 1 6").
        """
        self.found = self.found or key == self.key
        return stored(key)

    def get_reward(self) -> float:
        return 0.5 if self.found else 0.0

    def close(self):
        self.closed = True
'''


@pytest.fixture(scope="module")
def agent_assets(tmp_path_factory) -> tuple[Path, Path, dict]:
    """The agent demo's data and model after a short SFT (it calls the tool, and solves some lists), and the
    environment module on the launched processes' path."""
    from finetune.run import demo_agent

    root = tmp_path_factory.mktemp("agent")
    demo_agent.build(str(root))
    (root / "shelf.py").write_text(ENVIRONMENT)
    data = root / "agent" / "data"
    overrides = [
        f"model.name_or_path={root / 'agent' / 'base'}", f"data.train_path={data / 'sft_train.jsonl'}",
        f"data.eval_path={data / 'sft_eval.jsonl'}", f"output.dir={root / 'sft'}", "train.max_steps=150",
        "train.eval_every_steps=0",
    ]  # fmt: skip
    result = launch("fsdp2_full_shard.yaml", overrides, recipe=AGENT_SFT)
    assert result.returncode == 0, result.stderr[-4000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return root, root / "sft" / "final", env


def _agent_grpo(
    assets, name: str, processes: int, output_dir: Path | None = None, config: str | None = None, **extra
) -> LaunchedRun:
    root, model, env = assets
    data = root / "agent" / "data"
    values = {
        "model.name_or_path": model, "data.train_path": data / "prompts_train.jsonl",
        "data.eval_path": data / "prompts_eval.jsonl", "output.dir": output_dir or root / name,
        "output.trackers": "[]",
        "rl.tools": "[]", "rl.environment_factory": "shelf:Lists", "train.max_steps": 4, "train.eval_every_steps": 4,
        "train.log_every_steps": 1, "optim.warmup_steps": 0, "train.global_batch_size": 8,
        "train.micro_batch_size": 4, "rl.num_generations": 4, "rl.max_new_tokens": 48,
        "checkpoint.save_every_steps": 2, "optim.lr": 1e-3, **extra,
    }  # fmt: skip
    config = config or ("single_gpu.yaml" if processes == 1 else "fsdp2_full_shard.yaml")
    overrides = [f"{key}={value}" for key, value in values.items()]
    result = launch(config, overrides, num_processes=processes, recipe=AGENT_GRPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, values["output.dir"])


@pytest.fixture(scope="module")
def agent_runs(agent_assets) -> tuple[LaunchedRun, LaunchedRun]:
    return _agent_grpo(agent_assets, "one", 1), _agent_grpo(agent_assets, "two", 2)


@pytest.mark.multiprocess
def test_episodes_sample_and_train_the_same_on_one_process_and_two(agent_runs):
    """Episodes that call an environment's tool, rewarded by the data and by the environment: every logged value
    and the weights the same on 1 and 2 processes (the processes' episodes take different numbers of turns, in
    lock-step under FSDP2)."""
    one, two = agent_runs
    steps = one.per_step()
    assert sorted(steps) == [1, 2, 3, 4]
    for step, values in two.per_step().items():
        assert values == pytest.approx(steps[step], rel=1e-4, abs=1e-6), step
    first = steps[1]
    assert first["tools/call_frequency"] > 0.5 and first["episodes/turns"] > 1.5  # the SFT model calls the tool
    assert first["rewards/Lists/mean"] > 0 and "rewards/exact_match/mean" in first  # the environment's reward
    assert 0 <= first["tools/failure_frequency"] < 1 and "episodes/cut_ratio" in first
    timed = next(m for m in two.metrics() if "loss" in m)  # decoding's wait for the tools, apart
    assert 0 <= timed["generation/tool_seconds"] < timed["generation/seconds"]
    weights = [load_file(run.output_dir / "final" / "model.safetensors") for run in agent_runs]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 1e-5
    evaluated = [[m for m in run.metrics() if "eval_reward" in m] for run in agent_runs]
    assert len(evaluated[0]) == len(evaluated[1]) == 1 and evaluated[0][0] == pytest.approx(evaluated[1][0])
    assert "agents: tool calls: calls as JSON objects" in two.log and "'<|tool|>RESULT<|end|><|assistant|>'" in two.log


@pytest.mark.multiprocess
def test_episodes_resume_mid_run_exactly_on_another_process_count(agent_runs, agent_assets, tmp_path):
    _, two = agent_runs
    output_dir = tmp_path / "out"
    shutil.copytree(two.output_dir / "checkpoints" / "step_2", output_dir / "checkpoints" / "step_2")
    resumed = _agent_grpo(agent_assets, "", 1, output_dir, "fsdp2_full_shard.yaml", **{"checkpoint.resume": "auto"})
    expected = two.per_step()
    assert sorted(resumed.per_step()) == [3, 4]
    for step, values in resumed.per_step().items():
        assert values == pytest.approx(expected[step], rel=1e-4, abs=1e-6), step
    final, wanted = (load_file(run.output_dir / "final" / "model.safetensors") for run in (resumed, two))
    assert max((final[k] - wanted[k]).abs().max().item() for k in final) < 1e-5


@pytest.mark.multiprocess
def test_episodes_train_lora_adapters(agent_assets, tmp_path):
    """GRPO over episodes with LoRA on the SFT model: the episodes call the tool, and the adapters trained on them
    are what the export holds (lora_B starts at zero: a nonzero one was trained)."""
    settings = {
        "peft.method": "lora", "peft.r": 8, "peft.alpha": 16, "train.max_steps": 2, "train.eval_every_steps": 0,
        "checkpoint.save_every_steps": 0, "data.eval_path": "null",
    }  # fmt: skip
    run = _agent_grpo(agent_assets, "lora", 1, tmp_path / "lora", **settings)
    steps = run.per_step()
    assert sorted(steps) == [1, 2] and steps[1]["tools/call_frequency"] > 0.5 and steps[1]["episodes/turns"] > 1.5
    adapter = load_file(run.output_dir / "final" / "adapter_model.safetensors")
    trained = [key for key, value in adapter.items() if "lora_B" in key and value.abs().max() > 0]
    assert trained, sorted(adapter)[:4]


def test_check_prints_the_call_format_and_the_result_text_it_learnt(tmp_path, capsys):
    """A user sees before training whether their model's calls will be read, and what a result reads like."""
    from finetune.cli import main
    from finetune.run import demo_agent

    demo_agent.build(str(tmp_path))
    data = tmp_path / "agent" / "data"
    code = main([
        "check", "--config", str(REPO / "accelerate_configs" / "fsdp2_full_shard.yaml"), str(AGENT_GRPO),
        f"model.name_or_path={tmp_path / 'agent' / 'base'}", f"data.train_path={data / 'prompts_train.jsonl'}",
        f"data.eval_path={data / 'prompts_eval.jsonl'}",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and 'tool calls: calls as JSON objects {"name": NAME, "arguments": {...}} after' in out
    assert "a result reads '<|tool|>RESULT<|end|><|assistant|>'" in out and "otherwise" not in out


@pytest.mark.multiprocess
def test_training_reads_the_log_probabilities_the_episodes_were_sampled_with(agent_assets, monkeypatch):
    """Episodes sampled with the SFT model (calls, answers, a second turn), then laid out as training lays them
    (shared rows: a prompt once, its episodes after it): the log-probability training computes for each token the
    model wrote equals the sampler's, in the context the model sampled it in. Played again with the cache rebuilt
    from the ids it holds at every step (as it is when the answers' padding crowds it), the episodes are the same."""
    from transformers import AutoModelForCausalLM

    from finetune.data.rollout import shared_rows
    from finetune.engine import shared_attention
    from finetune.objectives.loss import token_logps
    from finetune.rollouts import episodes as module
    from finetune.rollouts.generation import Sampling, row_noise

    root, folder, _ = agent_assets
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tools = load_tools(["finetune.run.demo_agent:lookup"])
    agent = Agent(tokenizer, tool_template(tokenizer), tools, None, 3, 10.0, [tokenizer.eos_token_id])
    rows = [json.loads(line) for line in (root / "agent" / "data" / "test.jsonl").read_text().splitlines()[:6]]
    prompts = [tokenizer.apply_chat_template(r["prompt"], tools=agent.schemas, add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for r in rows]  # fmt: skip
    episodes = [Episode(p, {t.name: t for t in tools}, agent.schemas) for p in prompts for _ in range(2)]
    temperature = 0.7
    sampled: dict[int, list[float]] = {n: [] for n in range(len(episodes))}
    picker = module.picker

    def recording(sampling):
        pick = picker(sampling)

        def recorded(logits, live, places):
            tokens = pick(logits, live, places)
            logps = torch.log_softmax(logits.float() / temperature, -1).gather(1, tokens)[:, 0]
            for row, logp in zip(live.tolist(), logps.tolist(), strict=True):
                if not episodes[row].end:
                    sampled[row].append(logp)
            return tokens

        return recorded

    monkeypatch.setattr(module, "picker", recording)
    noise = row_noise([(0, n) for n in range(len(episodes))], 64)
    with torch.no_grad():
        kept = play(model, episodes, agent, tokenizer.pad_token_id, 64, Sampling(temperature, 1.0, noise), False, 2)
    assert sum(e.counts["turns"] >= 2 for e in episodes) >= len(episodes) // 2  # answers read, then a turn more
    # The same episodes when the cache is rebuilt from the ids it holds at every step (room -1: always crowded).
    monkeypatch.setattr(module, "picker", picker)
    again = [Episode(p, {t.name: t for t in tools}, agent.schemas) for p in prompts for _ in range(2)]
    with torch.no_grad():
        rebuilt = play(
            model, again, agent, tokenizer.pad_token_id, 64, Sampling(temperature, 1.0, noise), False, 2, room=-1
        )
    assert rebuilt > kept and [e.ids for e in again] == [e.ids for e in episodes]
    shared_attention.register()
    model.set_attn_implementation(shared_attention.NAME)
    layout = shared_rows([e.prompt for e in episodes], [e.ids for e in episodes], 2, tokenizer.pad_token_id)
    with torch.no_grad():
        trained = token_logps(model, layout, "chunked", temperature)
    wrote = torch.tensor([w for e in episodes for w in e.wrote], dtype=torch.bool)
    expected = torch.tensor([logp for n in range(len(episodes)) for logp in sampled[n]])
    assert wrote.sum() == len(expected) and (trained[wrote] - expected).abs().max() < 1e-4


def test_environments_are_closed_whatever_ends_their_episodes(tmp_path, monkeypatch):
    (tmp_path / "agent_shelf.py").write_text(
        "opened = []\n\n\nclass Shelf:\n    def __init__(self):\n        self.closed = False\n"
        "        opened.append(self)\n\n    def reset(self, answer, **row):\n"
        "        if answer == 'boom':\n            raise KeyError('no such shelf')\n        self.answer = answer\n\n"
        "    def get_reward(self) -> float:\n        return float(len(self.answer))\n\n"
        "    def close(self):\n        self.closed = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import agent_shelf

    factory = EnvironmentFactory.load("agent_shelf:Shelf", [])
    agent = Agent(None, None, [], factory, 2, 1.0, [0])
    rows = [{"prompt": "a", "answer": "12", "prompt_index": 0}, {"prompt": "b", "answer": "3", "prompt_index": 1}]
    episodes = agent.begin([[1], [2]], rows, 1)
    assert agent.end(episodes) == [2.0, 1.0] and all(e.environment.closed for e in episodes)
    agent_shelf.opened.clear()
    with pytest.raises(FinetuneError, match=r"reset raised KeyError: 'no such shelf' \(given the prompt's row"):
        agent.begin([[1], [2]], [rows[0], {**rows[1], "answer": "boom"}], 1)
    assert len(agent_shelf.opened) == 2 and all(shelf.closed for shelf in agent_shelf.opened)
    episodes = agent.begin([[1]], [{"prompt": "c", "answer": None, "prompt_index": 2}], 1)
    with pytest.raises(FinetuneError, match=r"get_reward raised TypeError: .*fix the environment"):
        agent.end(episodes)  # len(None)
    assert episodes[0].environment.closed


def test_text_an_environment_returns_at_reset_is_appended_to_the_prompt_and_shared_by_its_episodes(tmp_path):
    """TRL's protocol: reset's text ends the last user message; a group's episodes share their prompt, so text that
    differs between them is refused, every environment closed."""
    from finetune.run import demo_agent

    demo_agent.build(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "agent" / "base")
    (tmp_path / "agent_board.py").write_text(
        "import itertools\ncount = itertools.count()\n\n\nclass Board:\n"
        "    def reset(self, prompt, seen=False, **row):\n"
        "        return ' (the board: ' + ('x' if not seen else str(next(count))) + ')'\n\n"
        "    def close(self):\n        self.closed = True\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        factory = EnvironmentFactory.load("agent_board:Board", [])
        agent = Agent(tokenizer, tool_template(tokenizer), [], factory, 2, 1.0, [tokenizer.eos_token_id])
        prompt = [{"role": "user", "content": "reverse list 1 2 3"}]
        episodes = agent.begin([[1], [1]], [{"prompt": prompt, "prompt_index": 0}] * 2, 2)
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": "reverse list 1 2 3 (the board: x)"}], add_generation_prompt=True,
            tokenize=True, return_dict=False,
        )  # fmt: skip
        assert all(e.prompt == expected for e in episodes)
        agent.end(episodes)
        rows = [{"prompt": prompt, "seen": True, "prompt_index": 0}] * 2
        with pytest.raises(FinetuneError, match="reset returned different text for the episodes of one prompt"):
            agent.begin([[1], [1]], rows, 2)
    finally:
        sys.path.remove(str(tmp_path))


def test_episodes_that_end_without_an_answer_get_the_unfinished_reward_alone_when_one_is_set():
    from finetune.config import RewardConfig, load_recipe
    from finetune.objectives.advantages import advantages
    from finetune.rollouts.rewards import EPISODE_ENDS, build_rewards, score, unfinished_only, unfinished_reward

    rewards = [*build_rewards([RewardConfig(function="exact_match", column="answer")]), unfinished_reward(-0.5)]
    ends = ["answer", "length", "unread", "answer"]
    given = [[{"role": "assistant", "content": text}] for text in ("4 3", "4 3", "x", "1")]
    columns = {"answer": ["4 3"] * 4, EPISODE_ENDS: ends}
    scores = unfinished_only(score(rewards, ["p"] * 4, given, [[1]] * 4, columns), ends, [r.name for r in rewards])
    # The cut episode wrote the right digits before its budget ran out: no answer, so it is not credited for them.
    _, total, _ = advantages(scores, torch.tensor([1.0, 1.0]), 4, "group")
    assert total.tolist() == [1.0, -0.5, -0.5, 0.0]
    assert load_recipe(AGENT_GRPO, ["rl.unfinished_reward=-1"]).rl.unfinished_reward == -1.0
    with pytest.raises(FinetuneError, match="rl.unfinished_reward scores episodes .* remove it"):
        load_recipe(AGENT_GRPO, ["rl.tools=[]", "rl.unfinished_reward=-1"])


def test_the_calculator_computes_arithmetic_and_refuses_everything_else():
    """The recipes' calculator (finetune.rollouts.calculator): arithmetic only, never Python's eval; a refusal is an
    exception, which an episode turns into the error text the model reads."""
    from finetune.rollouts.calculator import calculate

    assert calculate("(12.5 - 3) * 4 ** 2") == "152" and calculate("7 / 2") == "3.5" and calculate("-2**3") == "-8"
    assert calculate(" 17 // 5 + 17 % 5 ") == "5"
    for expression in ("__import__('os').getcwd()", "9**9**9", "1/0", "x + 1", "True + 1", "1e300 * 1e300", "2 +"):
        with pytest.raises((ValueError, ZeroDivisionError, SyntaxError)):
            calculate(expression)
    tools = {"calculate": tool_of(calculate, "rl.tools")}
    (((outcome,), _),) = run_calls([([Call("calculate", {"expression": "1/0"})], tools, 5.0)])
    assert outcome.error == "error" and outcome.text.startswith("Error: ")
