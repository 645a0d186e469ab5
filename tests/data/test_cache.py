"""The cache's keys and writes: tokenizer fingerprints, file-content identity, atomic save and load."""

from __future__ import annotations

import copy
import json

import datasets
import pytest

from tuneforge.data import cache, registry
from tuneforge.errors import DataError


def test_tokenizer_fingerprint_follows_the_vocabulary(tokenizer):
    same = copy.deepcopy(tokenizer)
    assert cache.tokenizer_fingerprint(same) == cache.tokenizer_fingerprint(tokenizer)
    same.add_tokens(["<new_token>"])
    assert cache.tokenizer_fingerprint(same) != cache.tokenizer_fingerprint(tokenizer)


def test_dataset_identity_hashes_file_contents(tmp_path):
    (tmp_path / "rows.json").write_text("[]")
    attr = registry.parse_entry("r", {"file_name": "rows.json"})
    before = cache.dataset_identity(attr, str(tmp_path))
    (tmp_path / "rows.json").write_text("[ ]")
    after = cache.dataset_identity(attr, str(tmp_path))
    assert before["files"][0][0] == after["files"][0][0] == "rows.json"
    assert before["files"][0][1] != after["files"][0][1]


def test_save_is_atomic_and_replace_is_explicit(tmp_path):
    target = tmp_path / "entry"
    first = {"train": datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]})}
    cache.save_splits(first, {"samples": 1}, target, replace=False)
    second = {"train": datasets.Dataset.from_dict({"input_ids": [[3]], "labels": [[3]]})}
    cache.save_splits(second, {"samples": 2}, target, replace=False)  # another process got there first: kept
    train, evaluation, stats = cache.load_splits(target, cache_hit=True)
    assert train["input_ids"][:] == [[1, 2]] and evaluation is None
    assert stats == {"samples": 1, "cache_hit": True, "cache_dir": str(target)}
    cache.save_splits(second, {"samples": 2}, target, replace=True)
    assert cache.load_splits(target, cache_hit=False)[0]["input_ids"][:] == [[3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no temporary folders left
    assert json.loads((target / "stats.json").read_text()) == {"samples": 2}


def test_loading_a_folder_that_is_not_tokenized_data(tmp_path):
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(DataError, match="is not a tokenized dataset folder"):
        cache.load_splits(tmp_path, cache_hit=True)
