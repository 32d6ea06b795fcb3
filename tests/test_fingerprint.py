"""weights_fingerprint, which resume, `export --merge` and the preference reference cache rely on: any changed
byte of any tensor changes it, a copy keeps it, and each file is read once per version of it."""

from __future__ import annotations

import shutil

from helpers import DEMO_RECIPE, flip_one_weight_between_samples

from finetune.config import load_recipe
from finetune.model.loading import base_fingerprint
from finetune.objectives.reference import reference_key
from finetune.storage import fingerprint
from finetune.storage.fingerprint import file_digest, matches, sampled_fingerprint, weights_fingerprint


def test_one_changed_weight_changes_the_fingerprint_and_a_copy_keeps_it(demo_assets, tmp_path):
    base = shutil.copytree(demo_assets / "base", tmp_path / "base")
    before = weights_fingerprint(base)
    assert weights_fingerprint(shutil.copytree(base, tmp_path / "copy")) == before
    flip_one_weight_between_samples(base / "model.safetensors")
    assert weights_fingerprint(base) != before


def test_a_preference_runs_reference_cache_is_keyed_by_every_byte_of_its_base(demo_assets, tmp_path):
    """A base re-exported in place by the next SFT run has other reference log-probabilities: another key."""
    base = shutil.copytree(demo_assets / "base", tmp_path / "base")
    recipe = load_recipe(DEMO_RECIPE, [f"model.name_or_path={base}"])
    key = reference_key(base_fingerprint(recipe.model.name_or_path), [], "float32")
    flip_one_weight_between_samples(base / "model.safetensors")
    assert reference_key(base_fingerprint(recipe.model.name_or_path), [], "float32") != key


def test_each_file_is_hashed_once_per_version(demo_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    hashed = []
    original = fingerprint.xxhash.xxh3_128
    monkeypatch.setattr(fingerprint.xxhash, "xxh3_128", lambda: hashed.append(1) or original())
    weights = shutil.copytree(demo_assets / "base", tmp_path / "base") / "model.safetensors"
    first = file_digest(weights)
    assert file_digest(weights) == first and len(hashed) == 1  # the second time from the cache
    flip_one_weight_between_samples(weights)  # in place: the same path, size and inode
    assert file_digest(weights) != first and len(hashed) == 2
    (tmp_path / "cache" / "file_digests.json").write_text("{half a fil")  # a crashed write costs a hash
    assert file_digest(weights) != first and len(hashed) == 3


def test_checkpoints_of_earlier_versions_are_compared_as_they_recorded(demo_assets, tmp_path):
    """Their records are sampled fingerprints (16 bare hex digits): resume and merge still accept their base."""
    base = shutil.copytree(demo_assets / "base", tmp_path / "base")
    recorded_then, recorded_now = sampled_fingerprint(base), weights_fingerprint(base)
    assert len(recorded_then) == 16 and not recorded_then.startswith(fingerprint.PREFIX)
    assert matches(base, recorded_then) and matches(base, recorded_now)
    flip_one_weight_between_samples(base / "model.safetensors")
    assert not matches(base, recorded_now)
    assert matches(base, recorded_then)  # what the old records could not see, and why they were replaced
