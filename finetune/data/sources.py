"""Where samples come from: local json/jsonl/csv/parquet files or folders of them, or the hub.

Local paths are checked before anything loads (they exist, hold one file type, are not empty), and
a file that cannot be read is reported with the file and line where it stops being valid.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import numpy

from finetune.config import DataConfig, SourceConfig
from finetune.data.chat import names_a_template, read_chat_template
from finetune.engine.quiet import no_datasets_bars
from finetune.errors import FinetuneError, first_line

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def check_sources(cfg: DataConfig) -> None:
    """What can be checked of the data before anything loads: local paths exist, hold one supported
    file type, and are not empty; splits are named only where there are splits to choose."""
    # Each path with the recipe keys that name it and its split, as the user wrote them.
    if cfg.train is not None:
        named = [(s.path, s.split, f"data.train[{n}].path", f"data.train[{n}].split", s.subset)
                 for n, s in enumerate(cfg.train)]  # fmt: skip
    else:
        named = [(cfg.train_path, cfg.train_split, "data.train_path", "data.train_split", None)]
    named.append((cfg.eval_path, cfg.eval_split, "data.eval_path", "data.eval_split", None))
    for path, split, path_key, split_key, subset in named:
        if path is None:
            continue
        local = Path(path).expanduser()
        looks_local = local.exists() or local.suffix in LOCAL_BUILDERS or path.startswith(("/", "./", "../", "~"))
        if not looks_local:
            continue  # a hub dataset id
        if not local.exists():
            raise FinetuneError(f"{path_key} {path} does not exist; point it at a data file or folder")
        local_files(local_subset(local, subset))  # raises for unsupported, mixed or empty
        if split != "train":
            raise FinetuneError(
                f"{split_key}={split!r} has no effect on local data {path}, which is one split; point "
                f"{path_key} at that split's file and leave {split_key} out"
            )
    if cfg.chat_template is not None and not names_a_template(cfg.chat_template):
        read_chat_template(cfg.chat_template)  # a file or a template that renders a conversation


def local_files(path: Path) -> tuple[str, list[str]]:
    """The `datasets` builder and the files of a local data file, or of a folder of them."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
    kinds = {LOCAL_BUILDERS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        found = ", ".join(sorted({p.suffix or p.name for p in files}))
        raise FinetuneError(
            f"{path} holds {found} files; a data path is one file or a folder of files of one type "
            f"({', '.join(LOCAL_BUILDERS)}): move the others out"
        )
    if not files or all(p.stat().st_size == 0 for p in files):
        raise FinetuneError(f"{path} is empty; point the data path at a file with samples")
    return kinds.pop(), [str(p) for p in files]


def local_subset(path: Path, subset: str | None) -> Path:
    """A local source's `subset`: the subfolder of that name (a folder laid out as a hub dataset's
    configurations); refused on a file, or where no such subfolder is."""
    if subset is None:
        return path
    if path.is_dir() and (path / subset).is_dir():
        return path / subset
    entries = path.iterdir() if path.is_dir() else []
    folders = sorted(p.name for p in entries if p.is_dir() and not p.name.startswith("."))
    holds = f"its subfolders: {', '.join(folders)}" if folders else "it has no subfolders"
    raise FinetuneError(
        f"subset={subset!r} names a configuration of a hub dataset, but {path} is local data and {holds}; name an "
        "existing subfolder, or leave subset out"
    )


def _hidden(file: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in file.relative_to(root).parts)


SAMPLE_INDEX = "__finetune_sample__"
"""A column of each sample's position in its file (or split), added before anything reorders samples, so
that data errors name the sample where the user can find it; dropped by tokenization."""
MAX_SOURCE_SAMPLES = 100_000_000
"""The most samples one source may make of a mixture with its `fraction` (repeats are indices, not copies,
but an index list that long is 800 MB, and such a fraction is a typo)."""


def load_source(source: SourceConfig) -> datasets.Dataset:
    """One source of the training data, its columns renamed to finetune's (`source.columns`), each sample
    numbered by its position in the file (`SAMPLE_INDEX`)."""
    dataset = numbered(load_split(source.path, source.split, source.subset))
    left_out = [ours for ours, theirs in source.columns.items() if theirs is None]
    wanted = [theirs for theirs in source.columns.values() if theirs is not None]
    missing = [column for column in wanted if column not in dataset.column_names]
    if missing:
        raise FinetuneError(
            f"data.train source {source.path} has no column {', '.join(missing)} (its columns: "
            f"{', '.join(c for c in dataset.column_names if c != SAMPLE_INDEX)}); fix its columns mapping"
        )
    dataset = dataset.remove_columns([column for column in left_out if column in dataset.column_names])
    renamed = {theirs: ours for ours, theirs in source.columns.items() if theirs is not None and theirs != ours}
    return dataset.select_columns(
        [c for c in dataset.column_names if c in renamed or c not in renamed.values()]
    ).rename_columns(renamed)


def numbered(dataset: datasets.Dataset) -> datasets.Dataset:
    """`dataset` with each sample's position in it as the `SAMPLE_INDEX` column."""
    return dataset.add_column(SAMPLE_INDEX, numpy.arange(len(dataset), dtype=numpy.int64))


def hold_out(dataset: datasets.Dataset, fraction: float, seed: int, where: str) -> tuple[datasets.Dataset, ...]:
    """A seeded `fraction` of `dataset` held out for evaluation: (train, held out). Done before a source's
    `fraction` repeats it, so no held-out sample is also trained on."""
    held = math.ceil(fraction * len(dataset))
    if held >= len(dataset):
        raise FinetuneError(
            f"{where} has {len(dataset)} sample(s): holding out data.eval_fraction={fraction:g} of them would leave "
            "none to train on; add samples, or evaluate on a file of its own (data.eval_path)"
        )
    split = dataset.train_test_split(test_size=held, seed=seed)
    return split["train"], split["test"]


def take_fraction(dataset: datasets.Dataset, source: SourceConfig, seed: int) -> datasets.Dataset:
    """The source's `fraction` of `dataset`: every sample int(fraction) times, plus a seeded subset for the
    rest; repeats select the same rows again (an index list), never copies of the data."""
    if source.fraction == 1:
        return dataset
    whole, rest = int(source.fraction), source.fraction - int(source.fraction)
    extra = round(rest * len(dataset))
    total = whole * len(dataset) + extra
    if total > MAX_SOURCE_SAMPLES:
        raise FinetuneError(
            f"data.train source {source.path}: fraction={source.fraction:g} of its {len(dataset):,} samples makes "
            f"{total:,}, more than {MAX_SOURCE_SAMPLES:,}; lower the fraction (or use train.num_epochs for passes)"
        )
    if total == 0:
        raise FinetuneError(
            f"data.train source {source.path}: fraction={source.fraction:g} of its {len(dataset):,} samples rounds to "
            f"none; raise it to at least {1 / len(dataset):.2g}, or remove the source"
        )
    subset = numpy.random.default_rng(seed).permutation(len(dataset))[:extra]
    return dataset.select(numpy.concatenate([numpy.tile(numpy.arange(len(dataset)), whole), subset]))


def load_split(path: str, split: str, subset: str | None = None) -> datasets.Dataset:
    """A split from a local json/jsonl/csv/parquet file or folder of them, or from the hub (of its
    configuration `subset`, if given)."""
    local = Path(path).expanduser()
    try:
        if local.exists():
            local = local_subset(local, subset)
            builder, files = local_files(local)
            with no_datasets_bars():  # "Generating train split": a step of the split's tokenization
                dataset = datasets.load_dataset(builder, data_files=files, split="train")
            # datasets stores text that is not UTF-8 as is, to fail on first access deep inside a map; this
            # full validation (Arrow, in C++) finds it now, and the message below says where it is.
            dataset.data.table.validate(full=True)
            return dataset
        return datasets.load_dataset(path, subset, split=split)
    except FinetuneError:
        raise
    except Exception as exc:  # datasets raises many types for missing files, bad JSON, no network
        where = _locate_problem(local) if local.exists() else None
        raise FinetuneError(
            f"cannot load dataset {path!r} split {split!r}: {where or first_line(exc)}; check data.train_path / "
            "data.train / data.eval_path"
        ) from None


def _locate_problem(path: Path) -> str | None:
    """The file and line where a local text dataset stops being valid UTF-8 (or, for JSON Lines,
    valid JSON), for the error message."""
    for file in map(Path, local_files(path)[1]):
        if file.suffix not in (".json", ".jsonl", ".csv"):
            continue
        with file.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"{file}:{number}: byte {raw[exc.start]:#04x} at column {exc.start + 1} is not UTF-8"
                try:
                    if file.suffix == ".jsonl" and line.strip():
                        json.loads(line)
                except ValueError as exc:
                    return f"{file}:{number}: not a JSON object ({exc})"
    return None


def source_name(source: SourceConfig | None, cfg: DataConfig, evaluation: bool = False) -> str | None:
    """How data errors name a source: the recipe key that holds it, and whether it is evaluation data."""
    if source is None:
        return None
    if evaluation:
        return f"data.eval_path {source.path}" if cfg.eval_path else f"held-out eval samples of {source.path}"
    return f"data.train source {source.path}" if cfg.train is not None else f"data.train_path {source.path}"
