"""What identifies a model's weights: `weights_fingerprint`, which every check of "the same base" relies on.

A resume refuses another base than its checkpoint trained on, `export --merge` refuses to merge an adapter onto
another base, and a preference run's cached reference log-probabilities are keyed by their base. The usual way
to get "another base under the same name" is a folder re-exported in place by the next fine-tuning run, whose
every weight moved by a little: only a hash of every byte tells it apart for sure (a hash of sampled bytes
did not, on the demo model). Hashing is xxh3-128, which reads faster than a disk delivers, and each file's
hash is cached by the file's identity (path, size, modification and change times, inode) in
`$FINETUNE_CACHE` (default `~/.cache/finetune`): a folder is read whole once, and again only once rewritten.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import xxhash

_CACHED_FILES = 1024  # digests kept, the most recent ones: a cache of file identities, not of weights
PREFIX = "all-"  # fingerprints of every byte; checkpoints written before them recorded 16 bare hex digits
_SAMPLE_BYTES = 4096  # what those older fingerprints hashed: 16 evenly spaced samples of each file


def weights_fingerprint(folder: Path) -> str:
    """A hash of the model in `folder`: its config (less the fields that name rather than define it) and every
    byte of its weight files (safetensors, else .bin). Any change to any tensor changes it; a copy of the
    folder elsewhere keeps it."""
    digest = _config_digest(folder)
    for file in weight_files(folder):
        digest.update(f"{file.name}:{file_digest(file)}".encode())
    return PREFIX + digest.hexdigest()[:16]


def matches(folder: Path, recorded: str) -> bool:
    """Whether `folder` holds the model whose fingerprint a checkpoint recorded. A record written before
    fingerprints hashed every byte is compared as it was made (its size and 16 samples of each file), so that
    checkpoints of earlier versions still resume and merge."""
    return (weights_fingerprint(folder) if recorded.startswith(PREFIX) else sampled_fingerprint(folder)) == recorded


def sampled_fingerprint(folder: Path) -> str:
    """The fingerprint earlier versions recorded: each weight file's name, size and 16 evenly spaced 4 KiB
    samples. It misses a re-export whose changed bytes fall between samples: only for reading old records."""
    digest = _config_digest(folder)
    for file in weight_files(folder):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            for i in range(16):
                f.seek(i * max(size - _SAMPLE_BYTES, 0) // 15)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _config_digest(folder: Path) -> Any:  # a hashlib object
    digest = hashlib.sha256()
    config_file = folder / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for naming in ("_name_or_path", "transformers_version"):
            config.pop(naming, None)
        digest.update(json.dumps(config, sort_keys=True).encode())
    return digest


def weight_files(folder: Path) -> list[Path]:
    """The files that hold a model folder's weights: its safetensors, else its .bin files."""
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))


def file_digest(path: Path) -> str:
    """xxh3-128 of every byte of `path`, read once per version of the file (see the module's docstring)."""
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"
    cache = _read_cache()
    if identity in cache:
        return cache[identity]
    hasher = xxhash.xxh3_128()
    if stat.st_size:
        # Mapped, not read in chunks: no copy into Python objects, so hashing keeps up with the disk
        # (16 GiB: 7.6 s mapped, 10.3 s read into a buffer, 21.6 s read in 64 MiB chunks; `cat` 8.0 s).
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            hasher.update(mapped)
    digest = hasher.hexdigest()
    _write_cache({**cache, identity: digest})
    return digest


def cache_file() -> Path:
    """`$FINETUNE_CACHE/file_digests.json`; by default under `$XDG_CACHE_HOME/finetune` or `~/.cache/finetune`."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune"
    return Path(os.environ.get("FINETUNE_CACHE") or default) / "file_digests.json"


def _read_cache() -> dict[str, str]:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):  # none yet, unreadable, or half of a crashed write: hash again
        return {}


def _write_cache(entries: dict[str, str]) -> None:
    """Written whole and renamed into place (several processes may hash at once: the last one's file stands);
    a cache that cannot be written is only a cost, never an error."""
    path = cache_file()
    kept = dict(list(entries.items())[-_CACHED_FILES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(kept))
        partial.replace(path)
    except OSError:
        pass
