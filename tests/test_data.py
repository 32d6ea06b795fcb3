"""Data: loss masks per format, truncation accounting, packing boundaries, padding, loading."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from finetune.config import DataConfig, SourceConfig
from finetune.data import (
    IGNORE,
    check_sources,
    collate_padded,
    detect_format,
    encode_chats,
    load_split,
    pack,
    prepare_split,
    tokenize,
)
from finetune.data.tokenize import _tokenize_batch, encode_prompt_completions, encode_texts
from finetune.errors import FinetuneError

REPO_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo" / "tiny_llama.yaml"


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets / "base")


def trained_text(tokenizer, ids, trained) -> str:
    return tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t])


def chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


def test_chat_trains_every_assistant_turn_with_its_end_token(tokenizer):
    messages = chat(
        ("system", "be brief"), ("user", "reverse: 1 2"), ("assistant", "2 1"), ("user", "again"), ("assistant", "1 2")
    )
    (ids, trained), (single_ids, single_trained) = encode_chats([messages, messages[:3]], tokenizer, True)
    assert trained_text(tokenizer, ids, trained) == "2 1<|end|>1 2<|end|>"
    assert trained_text(tokenizer, single_ids, single_trained) == "2 1<|end|>"
    [(ids_all, trained_all)] = encode_chats([messages], tokenizer, completion_only=False)
    assert ids_all == ids and all(trained_all)


def test_prompt_completion_trains_completion_and_eos(tokenizer):
    [(ids, trained)] = encode_prompt_completions(["reverse: 3 4"], [" 4 3"], tokenizer, completion_only=True)
    assert trained_text(tokenizer, ids, trained) == " 4 3<|end|>"
    assert ids[0] == tokenizer.bos_token_id or tokenizer.bos_token_id not in ids
    [(_, trained_all)] = encode_prompt_completions(["reverse: 3 4"], [" 4 3"], tokenizer, completion_only=False)
    assert all(trained_all)


def test_a_text_completions_think_block_is_reasoning_kept_as_context_when_asked(tokenizer):
    cfg = DataConfig(train_path="x", max_length=64, packing=False, train_on_reasoning=False)
    rows = [{"prompt": "reverse: 3 4", "completion": "<think>swap</think> 4 3"}, {"prompt": "p", "completion": " q"}]
    kept, stats = prepare_split(datasets.Dataset.from_list(rows), tokenizer, cfg, 0)
    by_prompt = {tokenizer.decode(row["input_ids"]).split("<think>")[0]: row for row in kept}
    row = by_prompt["reverse: 3 4"]
    assert tokenizer.decode([t for t in row["target_ids"] if t != IGNORE]) == "<think></think> 4 3<|end|>"
    assert "swap" in tokenizer.decode(row["input_ids"]) and stats.num_reasoning_tokens == len(
        tokenizer("swap", add_special_tokens=False)["input_ids"]
    )


def test_text_trains_everything_and_ends_with_eos(tokenizer):
    [(ids, trained)] = encode_texts(["1 2 3"], tokenizer)
    assert all(trained) and ids[-1] == tokenizer.eos_token_id


def test_targets_are_next_tokens_within_the_sample(tokenizer):
    batch = {"messages": [chat(("user", "reverse: 1 2 3"), ("assistant", "3 2 1"))]}
    row = _tokenize_batch(batch, [0], tokenizer=tokenizer, fmt="chat", max_length=64, completion_only=True)
    [ids], [targets] = row["input_ids"], row["target_ids"]
    assert len(ids) == len(targets) and targets[-1] == IGNORE and row["truncated"] == [False]
    assert row["num_targets"] == [sum(t != IGNORE for t in targets)]
    for i, target in enumerate(targets[:-1]):
        assert target in (IGNORE, ids[i + 1])
    assert tokenizer.decode([t for t in targets if t != IGNORE]) == "3 2 1<|end|>"


def test_truncation_and_dropping_are_counted(tokenizer):
    long_answer = " ".join(["9"] * 40)
    raw = datasets.Dataset.from_list(
        [
            {"messages": chat(("user", "reverse: 1 2"), ("assistant", "2 1"))},
            {"messages": chat(("user", "reverse: " + long_answer), ("assistant", long_answer))},  # answer cut
            {"messages": chat(("user", "reverse: " + " ".join(["8"] * 60)), ("assistant", "8"))},  # answer gone
        ]
    )
    cfg = DataConfig(train_path="unused", max_length=48, packing=False)
    rows, stats = prepare_split(raw, tokenizer, cfg, seed=0)
    assert (stats.num_samples, stats.num_truncated, stats.num_dropped, stats.num_rows) == (3, 2, 1, 2)
    assert all(len(row["input_ids"]) <= 48 for row in rows)
    assert stats.num_target_tokens == sum(sum(t != IGNORE for t in row["target_ids"]) for row in rows)


def test_packing_fills_rows_and_never_predicts_across_samples(tokenizer):
    raw = datasets.Dataset.from_list(
        [{"messages": chat(("user", f"reverse: {i} {i + 1}"), ("assistant", f"{i + 1} {i}"))} for i in range(40)]
    )
    cfg = DataConfig(train_path="unused", max_length=64)
    tokenized = tokenize(raw, tokenizer, cfg)
    packed = pack(tokenized, 64, tokenizer.pad_token_id)
    assert len(packed) < len(tokenized)
    total_targets = 0
    for row in packed:
        assert len(row["input_ids"]) == len(row["target_ids"]) == len(row["position_ids"]) == 64
        positions, targets = row["position_ids"], row["target_ids"]
        for i in range(63):
            if positions[i + 1] == 0:  # a new sample (or the padding tail) starts at i + 1
                assert targets[i] == IGNORE
            else:
                assert positions[i + 1] == positions[i] + 1
        total_targets += sum(t != IGNORE for t in targets)
        assert row["num_tokens"] <= 64
    assert total_targets == sum(sum(t != IGNORE for t in row["target_ids"]) for row in tokenized)


def test_padded_collate_masks_padding(tokenizer):
    rows = [{"input_ids": [5, 6, 7], "target_ids": [6, 7, IGNORE]}, {"input_ids": [5], "target_ids": [IGNORE]}]
    batch = collate_padded(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["target_ids"].tolist() == [[6, 7, IGNORE], [IGNORE, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert int(batch["num_tokens"]) == 4


def test_format_detection_and_missing_columns():
    assert detect_format(["messages", "id"], "auto") == "chat"
    assert detect_format(["prompt", "completion"], "auto") == "prompt_completion"
    assert detect_format(["text"], "auto") == "text"
    with pytest.raises(
        FinetuneError, match=r"columns \['question', 'answer'\], expected messages or prompt\+completion"
    ):
        detect_format(["question", "answer"], "auto")
    with pytest.raises(FinetuneError, match="expected messages; rename the columns, or set data.format"):
        detect_format(["text"], "chat")


def test_empty_dataset_is_an_error(tokenizer):
    empty = datasets.Dataset.from_dict({"text": []})
    with pytest.raises(FinetuneError, match="the dataset is empty"):
        tokenize(empty, tokenizer, DataConfig(train_path="unused", max_length=32))


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_load(tmp_path, suffix):
    data = datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"]})
    path = tmp_path / f"data{suffix}"
    {".jsonl": data.to_json, ".json": data.to_json, ".csv": data.to_csv, ".parquet": data.to_parquet}[suffix](
        str(path)
    )
    loaded = load_split(str(path), "train")
    assert loaded.column_names == ["prompt", "completion"] and len(loaded) == 2


def test_unloadable_datasets_say_what_to_fix(tmp_path):
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(FinetuneError, match="holds .txt files; a data path is one file or a folder"):
        load_split(str(tmp_path / "data.txt"), "train")
    with pytest.raises(FinetuneError, match="cannot load dataset .*check data.train_path"):
        load_split(str(tmp_path / "missing"), "train")


def test_tokenization_is_cached_by_datasets(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    datasets.Dataset.from_list(
        [{"messages": chat(("user", f"reverse: {i} 1"), ("assistant", f"1 {i}"))} for i in range(10)]
    ).to_json(str(path))
    cfg = DataConfig(train_path=str(path), max_length=32)
    first = tokenize(load_split(str(path), "train"), tokenizer, cfg)
    second = tokenize(load_split(str(path), "train"), tokenizer, cfg)
    assert first.cache_files and first.cache_files == second.cache_files
    other = tokenize(load_split(str(path), "train"), tokenizer, DataConfig(train_path=str(path), max_length=16))
    assert other.cache_files != first.cache_files  # settings are part of the cache key


def test_content_parts_render_as_their_text(tokenizer):
    """Current datasets give content as a list of parts; it must train as that text, never as its repr."""
    plain = chat(("user", "reverse: 1 2"), ("assistant", "2 1"))
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "reverse: "}, {"type": "text", "text": "1 2"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "2 1"}], "tool_calls": None},
    ]
    assert encode_chats([parts], tokenizer, True) == encode_chats([plain], tokenizer, True)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [{"role": "user", "content": "q"}, {"role": "assistant"}],
            r"sample 7, message 1 \(assistant\) has no content",
        ),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}], "message 1 .* has no content"),
        ([{"content": "q"}], "sample 7, message 0: expected an object with a text role"),
        ("hello", "sample 7: messages must be a non-empty list of {role, content} objects, got str"),
        ([], "sample 7: messages must be a non-empty list"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "is not text; finetune trains on text parts"),
        ([{"role": "user", "content": 3}], "content must be text, got int"),
    ],
)
def test_malformed_conversations_name_the_sample(tokenizer, messages, message):
    with pytest.raises(FinetuneError, match=message):
        encode_chats([messages], tokenizer, True, indices=[7])


def test_null_prompt_completion_or_text_names_the_sample(tokenizer):
    batch = {"prompt": ["a", None], "completion": ["b", "c"]}
    with pytest.raises(FinetuneError, match="sample 4: prompt must be text, got NoneType"):
        _tokenize_batch(
            batch, [3, 4], tokenizer=tokenizer, fmt="prompt_completion", max_length=64, completion_only=True
        )


def test_chat_data_needs_a_chat_template(tokenizer):
    cfg = DataConfig(train_path="x", max_length=64)
    data = datasets.Dataset.from_list([{"messages": chat(("user", "q"), ("assistant", "a"))}])
    bare = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(FinetuneError, match="the tokenizer has no chat template"):
        tokenize(data, bare, cfg)


def test_data_without_anything_to_train_says_so(tokenizer):
    cfg = DataConfig(train_path="x", max_length=8)
    long_question = chat(("user", " ".join(["7"] * 20)), ("assistant", "7"))  # the reply is cut off
    data = datasets.Dataset.from_list([{"messages": long_question}] * 3)
    with pytest.raises(FinetuneError, match="none of the 3 samples has a token to train on \\(no assistant turn"):
        prepare_split(data, tokenizer, cfg, seed=0)
    no_reply = datasets.Dataset.from_list([{"messages": long_question}, {"messages": chat(("user", "q"))}])
    with pytest.raises(FinetuneError, match="sample 1 has no assistant message to train on; remove it"):
        prepare_split(no_reply, tokenizer, cfg, seed=0)


def test_local_sources_are_checked_before_loading(tmp_path):
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text(rows)
    (folder / "b.jsonl").write_text(rows)
    assert len(load_split(str(folder), "train")) == 6  # every file of the folder
    (folder / "c.csv").write_text("text\nhello\n")
    with pytest.raises(
        FinetuneError, match=r"holds .csv, .jsonl files; a data path is one file or a folder of files of one"
    ):
        check_sources(DataConfig(train_path=str(folder), max_length=64))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(FinetuneError, match="empty.jsonl is empty"):
        check_sources(DataConfig(train_path=str(tmp_path / "empty.jsonl"), max_length=64))
    with pytest.raises(FinetuneError, match="data.train_path .*missing.jsonl does not exist"):
        check_sources(DataConfig(train_path=str(tmp_path / "missing.jsonl"), max_length=64))
    (folder / "c.csv").unlink()
    with pytest.raises(FinetuneError, match="data.train_split='test' has no effect on local data"):
        check_sources(DataConfig(train_path=str(folder), train_split="test", max_length=64))


def test_bytes_that_are_not_utf8_are_located(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(FinetuneError, match=r"latin1.jsonl:2: byte 0xe9 at column 14 is not UTF-8"):
        load_split(str(path), "train")


def test_a_mixture_of_sources_is_mapped_sampled_counted_and_seeded(tmp_path, tokenizer):
    """data.train: a chat source under another column name, taken twice, and a prompt/completion source, a
    quarter of it; each counted in the log; the mixed order depends on the seed only."""
    from finetune.config import SourceConfig
    from finetune.data.sources import load_source, take_fraction

    def load(source, seed):
        return take_fraction(load_source(source), source, seed)

    chats = tmp_path / "chats.jsonl"
    datasets.Dataset.from_list(
        [{"conversations": chat(("user", f"reverse: {i} 1"), ("assistant", f"1 {i}")), "id": i} for i in range(10)]
    ).to_json(str(chats))
    pairs = tmp_path / "pairs.csv"
    datasets.Dataset.from_list([{"prompt": f"reverse: {i} 2", "completion": f" 2 {i}"} for i in range(40)]).to_csv(
        str(pairs), index=False
    )
    sources = [
        SourceConfig(path=str(chats), columns={"messages": "conversations"}, fraction=2.0),
        SourceConfig(path=str(pairs), fraction=0.25),
    ]
    cfg = DataConfig(train=sources, max_length=32, packing=False)
    mixture = [(source, load(source, seed=3)) for source in cfg.sources()]
    rows, stats = prepare_split(mixture, tokenizer, cfg, seed=3)
    assert [s.num_samples for _, s in stats.sources] == [20, 10] and stats.num_samples == len(rows) == 30
    lines = stats.describe("train data").splitlines()
    assert lines[0].startswith("train data: 30 samples") and lines[1].startswith(f"  {chats}: 20 samples")
    again, _ = prepare_split([(s, load(s, seed=3)) for s in sources], tokenizer, cfg, seed=3)
    assert again["input_ids"] == rows["input_ids"]
    other = load(sources[1], seed=4)["prompt"]
    assert sorted(other) != sorted(load(sources[1], seed=3)["prompt"])  # another seed, another quarter


def test_bad_mixtures_name_the_source(tmp_path, tokenizer):
    from finetune.config import ConfigError, SourceConfig, load_recipe
    from finetune.data.sources import load_source

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "model: {name_or_path: m}\ndata: {max_length: 32, train: [{path: a.jsonl, fraction: 0}, {path: b.jsonl, "
        "fraction: -1}]}\noptim: {lr: 1.0e-4}\ntrain: {max_steps: 1, micro_batch_size: 1}\noutput: {dir: out}\n"
    )
    with pytest.raises(ConfigError, match=r"data.train\[0\].fraction must be > 0.*data.train\[1\].fraction must be"):
        load_recipe(recipe)
    with pytest.raises(ConfigError, match="set data.train_path .* or data.train .*, not both"):
        load_recipe(recipe, ["data.train_path=c.jsonl", "data.train=[{path: a.jsonl}]"])
    data = tmp_path / "chats.jsonl"
    datasets.Dataset.from_list([{"messages": chat(("user", "q"))}]).to_json(str(data))
    with pytest.raises(FinetuneError, match=f"data.train source {data} has no column conversations"):
        load_source(SourceConfig(path=str(data), columns={"messages": "conversations"}))
    source = SourceConfig(path=str(data))
    cfg = DataConfig(train=[source, source], max_length=32)
    with pytest.raises(FinetuneError, match=f"data.train source {data}: sample 0 has no assistant message"):
        prepare_split([(s, load_source(s)) for s in cfg.sources()], tokenizer, cfg, seed=0)


def test_large_data_is_tokenized_in_parallel_with_the_same_result(tokenizer, monkeypatch):
    tokenize_module = importlib.import_module("finetune.data.tokenize")  # the package exports its function

    assert tokenize_module.map_processes(10_000) is None
    monkeypatch.setattr(tokenize_module.os, "cpu_count", lambda: 16)
    assert tokenize_module.map_processes(60_000) == 2 and tokenize_module.map_processes(10**6) == 8
    data = datasets.Dataset.from_list(
        [{"messages": chat(("user", f"reverse: {i} 7"), ("assistant", f"7 {i}"))} for i in range(300)]
    )
    cfg = DataConfig(train_path="x", max_length=32)
    serial = tokenize(data, tokenizer, cfg)
    monkeypatch.setattr(tokenize_module, "_PARALLEL_FROM", 100)
    assert tokenize_module.map_processes(len(data)) == 6
    parallel = tokenize(data, tokenizer, cfg)
    assert parallel.to_dict() == serial.to_dict()


def write_chats(path, count: int, bad: int | None = None) -> None:
    """`count` distinct conversations as JSON Lines; sample `bad` (if any) has no assistant reply."""
    samples = [chat(("user", f"reverse: {i} 5"), ("assistant", f"5 {i}")) for i in range(count)]
    if bad is not None:
        samples[bad] = chat(("user", "nothing answers this"))
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in samples))


def built(cfg: DataConfig, tokenizer):
    from accelerate import Accelerator

    from finetune.data import build_data

    return build_data(cfg, tokenizer, Accelerator(cpu=True), seed=0, micro_batch_size=1)


def test_held_out_samples_are_held_out_before_a_source_is_repeated(tmp_path, tokenizer):
    from finetune.config import SourceConfig

    write_chats(tmp_path / "chats.jsonl", 200)
    source = SourceConfig(path=str(tmp_path / "chats.jsonl"), fraction=2)
    data = built(DataConfig(train=[source], eval_fraction=0.2, max_length=32, packing=False), tokenizer)
    trained = [tuple(ids) for ids in data.train_loader.dataset["input_ids"]]
    held_out = {tuple(ids) for ids in data.eval_loader.dataset["input_ids"]}
    assert len(held_out) == 40 and len(trained) == 320 and len(set(trained)) == 160
    assert not held_out & set(trained)


def test_fractions_and_held_out_shares_that_cannot_be_built_are_refused(tmp_path, tokenizer, monkeypatch):
    from finetune.config import ConfigError, SourceConfig, load_recipe
    from finetune.data import sources

    with pytest.raises(ConfigError, match=r"fraction=1e\+09 repeats the source more than 1000 times"):
        load_recipe(REPO_RECIPE, ["data.train_path=", "data.train=[{path: a.jsonl, fraction: 1e9}]"])
    write_chats(tmp_path / "chats.jsonl", 50)
    monkeypatch.setattr(sources, "MAX_SOURCE_SAMPLES", 1000)
    source = SourceConfig(path=str(tmp_path / "chats.jsonl"), fraction=999)
    with pytest.raises(FinetuneError, match="fraction=999 of its 50 samples makes 49,950, more than 1,000"):
        built(DataConfig(train=[source], max_length=32), tokenizer)
    write_chats(tmp_path / "one.jsonl", 1)
    with pytest.raises(FinetuneError, match=r"one.jsonl has 1 sample\(s\): holding out data.eval_fraction=0.1"):
        built(DataConfig(train_path=str(tmp_path / "one.jsonl"), eval_fraction=0.1, max_length=32), tokenizer)


def test_a_subset_of_local_data_is_its_subfolder_or_refused(tmp_path, tokenizer):
    from finetune.config import SourceConfig
    from finetune.data.sources import check_sources, load_source

    for name, count in (("math", 3), ("code", 5)):
        (tmp_path / "mix" / name).mkdir(parents=True)
        write_chats(tmp_path / "mix" / name / "train.jsonl", count)
    assert len(load_source(SourceConfig(path=str(tmp_path / "mix"), subset="code"))) == 5
    assert len(load_source(SourceConfig(path=str(tmp_path / "mix")))) == 8
    missing = DataConfig(train=[SourceConfig(path=str(tmp_path / "mix"), subset="science")], max_length=32)
    with pytest.raises(FinetuneError, match="subset='science' .* its subfolders: code, math; name an existing"):
        check_sources(missing)
    on_file = SourceConfig(path=str(tmp_path / "mix" / "math" / "train.jsonl"), subset="math")
    with pytest.raises(FinetuneError, match="is local data and it has no subfolders"):
        check_sources(DataConfig(train=[on_file], max_length=32))


def test_data_errors_name_the_sample_by_its_place_in_its_file_and_say_which_data(tmp_path, tokenizer):
    write_chats(tmp_path / "train.jsonl", 30, bad=17)
    cfg = DataConfig(train_path=str(tmp_path / "train.jsonl"), eval_fraction=0.5, max_length=32)
    with pytest.raises(FinetuneError, match=r"train.jsonl: sample 17 has no assistant message"):
        built(cfg, tokenizer)  # the split shuffled the samples: the error still names the file's 17th
    write_chats(tmp_path / "good.jsonl", 30)
    write_chats(tmp_path / "eval.jsonl", 10, bad=4)
    cfg = DataConfig(train_path=str(tmp_path / "good.jsonl"), eval_path=str(tmp_path / "eval.jsonl"), max_length=32)
    with pytest.raises(FinetuneError, match=r"^data.eval_path .*eval.jsonl: sample 4 has no assistant message"):
        built(cfg, tokenizer)


@pytest.mark.parametrize("capacity", [2048, 8192])
def test_best_fit_fills_rows_of_chat_like_lengths_to_97_percent(capacity):
    """UltraChat-like lengths (log-normal, median about 1,000 tokens), cut at the row length as tokenization
    cuts them, one packing window: best-fit decreasing fills >= 97% of the slots, next-fit far less."""
    from finetune.data.pack import WINDOW, best_fit, next_fit

    generator = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(WINDOW, generator=generator) * 0.7 + math.log(1000)).long().clamp(8, capacity)
    lengths = lengths.tolist()
    rows = best_fit(lengths, capacity)
    assert sorted(n for row in rows for n in row) == list(range(WINDOW))  # every sample once
    assert all(sum(lengths[n] for n in row) <= capacity for row in rows)
    fill = sum(lengths) / (len(rows) * capacity)
    before = sum(lengths) / (len(next_fit(lengths, capacity)) * capacity)
    print(f"rows of {capacity}: best fit {fill:.3f}, next fit {before:.3f}")
    assert fill >= 0.97 and before < fill - 0.05
    assert best_fit(lengths, capacity) == rows  # deterministic


def test_eval_samples_are_a_seeded_subset_the_same_on_every_process_count(tmp_path, tokenizer):
    write_chats(tmp_path / "train.jsonl", 100)
    write_chats(tmp_path / "eval.jsonl", 60)
    cfg = DataConfig(train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl"),
                     eval_samples=25, max_length=32, packing=False)  # fmt: skip
    first = built(cfg, tokenizer).eval_loader.dataset["input_ids"]
    assert len(first) == 25 and built(cfg, tokenizer).eval_loader.dataset["input_ids"] == first  # seeded
    held = DataConfig(train_path=str(tmp_path / "train.jsonl"), eval_fraction=0.3, eval_samples=10, max_length=32)
    assert built(held, tokenizer).eval_stats.num_samples == 10
    with pytest.raises(FinetuneError, match="data.eval_samples=61 is more than the 60 eval samples there are"):
        built(DataConfig(**{**cfg.__dict__, "eval_samples": 61}), tokenizer)


def test_truncation_drop_leaves_long_samples_out_and_counts_them(tmp_path, tokenizer):
    samples = [chat(("user", "reverse: " + " ".join(["7"] * n)), ("assistant", " ".join(["7"] * n))) for n in (2, 14)]
    raw = datasets.Dataset.from_list([{"messages": messages} for messages in samples])
    for truncation, kept in (("truncate", 2), ("drop", 1)):
        cfg = DataConfig(train_path="x", max_length=32, packing=False, truncation=truncation)
        rows, stats = prepare_split(raw, tokenizer, cfg, seed=0)
        assert len(rows) == kept and stats.num_truncated == 1 and stats.num_dropped == 0
        assert ("1 dropped as longer than data.max_length" in stats.describe("train")) == (truncation == "drop")


def test_invalid_samples_are_dropped_and_counted_or_stop_the_run_past_one_percent(tokenizer):
    good = [{"messages": chat(("user", f"reverse: {i} 1"), ("assistant", f"1 {i}"))} for i in range(300)]
    bad = {"messages": chat(("user", "no reply"))}
    data = datasets.Dataset.from_list([*good[:150], bad, *good[150:]])
    with pytest.raises(FinetuneError, match="sample 150 has no assistant message"):
        prepare_split(data, tokenizer, DataConfig(train_path="x", max_length=32), seed=0)
    cfg = DataConfig(train_path="x", max_length=32, invalid="drop", packing=False)
    rows, stats = prepare_split(data, tokenizer, cfg, seed=0)
    assert len(rows) == 300 and stats.num_invalid == 1 and stats.num_dropped == 0
    assert "1 invalid dropped (first: sample 150 has no assistant message" in stats.describe("train")
    many = datasets.Dataset.from_list([*good[:100], bad, bad])
    with pytest.raises(FinetuneError, match=r"2 of its 102 samples are invalid, more than data.invalid=drop leaves"):
        prepare_split([(SourceConfig(path="many.jsonl"), many)], tokenizer, cfg, seed=0)


def test_packing_window_is_how_many_samples_are_packed_together(tmp_path, tokenizer):
    """A window of the whole data packs at least as full as windows of a few samples (each window's last row is
    left part-empty); the same window gives the same rows; a window past the data, or one with packing off or on a
    preference run, is refused with the fix."""
    from helpers import DEMO_RECIPE

    from finetune.config import load_recipe

    write_chats(tmp_path / "train.jsonl", 120)
    cfg = DataConfig(train_path=str(tmp_path / "train.jsonl"), max_length=64)
    rows = {window: built(DataConfig(**{**cfg.__dict__, "packing_window": window}), tokenizer).train_stats.num_rows
            for window in (5, 120)}  # fmt: skip
    assert rows[120] < rows[5]
    small = DataConfig(**{**cfg.__dict__, "packing_window": 5})
    assert (
        built(small, tokenizer).train_loader.dataset["input_ids"]
        == built(small, tokenizer).train_loader.dataset["input_ids"]
    )
    with pytest.raises(FinetuneError, match="data.packing_window=121 is more than the 120 training samples"):
        built(DataConfig(**{**cfg.__dict__, "packing_window": 121}), tokenizer)
    assert (
        "data.packing_window must be >= 1 sample, got 0"
        in DataConfig(**{**cfg.__dict__, "packing_window": 0}).errors()
    )
    unpacked = DataConfig(**{**cfg.__dict__, "packing_window": 50, "packing": False})
    assert any("but data.packing is false" in e for e in unpacked.errors())
    with pytest.raises(FinetuneError, match="data.packing_window applies to supervised fine-tuning"):
        load_recipe(DEMO_RECIPE, ["preference.loss=dpo", "data.format=auto", "data.packing_window=10"])
