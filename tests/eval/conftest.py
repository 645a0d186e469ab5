"""Helpers for the eval tests: configs on the tiny model, a private TUNEFORGE_HOME, a tiny benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from eval_helpers import ALPACA_ROWS, TOY_ROWS, write_csv, write_jsonl

from tuneforge.config import from_dict


@pytest.fixture
def toy_task(tmp_path) -> Path:
    """task_dir with the benchmark `toy` (test and dev splits): colors as CSV, numbers as JSONL, a mapping."""
    task_dir = tmp_path / "tasks"
    root = task_dir / "toy"
    for split in ("test", "dev"):
        write_csv(root / split / f"colors_{split}.csv", TOY_ROWS["colors"][split])
        write_jsonl(root / split / f"numbers_{split}.jsonl", TOY_ROWS["numbers"][split])
    (root / "mapping.json").write_text(json.dumps({
        "colors": {"name": "colours of things", "category": "Perception"},
        "numbers": {"name": "small numbers", "category": "STEM"},
    }))
    return task_dir


@pytest.fixture
def tiny_cfg(tiny_model_dir):
    """A validated eval config on the tiny model: tiny_cfg(key=value, ...)."""

    def make(for_training: bool = False, **keys: Any):
        return from_dict({"model_name_or_path": str(tiny_model_dir), **keys}, for_training=for_training)

    return make


@pytest.fixture
def alpaca_dir(tmp_path) -> Path:
    """dataset_dir with `tiny_alpaca` (ALPACA_ROWS) registered in dataset_info.json."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "tiny_alpaca.json").write_text(json.dumps(ALPACA_ROWS), encoding="utf-8")
    (root / "dataset_info.json").write_text(json.dumps({"tiny_alpaca": {"file_name": "tiny_alpaca.json"}}))
    return root
