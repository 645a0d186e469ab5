"""Helpers for the data tests: configs, small dataset folders, and a private TUNEFORGE_HOME."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tuneforge.config import from_dict


def _make_cfg(dataset_dir: str | Path, **keys: Any):
    """A validated RunConfig for data tests (no model is loaded)."""
    raw = {
        "model_name_or_path": "unused-by-data-tests",
        "dataset_dir": str(dataset_dir),
        "stage": "sft",
        "cutoff_len": 1024,
    }
    raw.update(keys)
    return from_dict(raw, for_training=False)


def _write_dataset(
    root: Path, name: str, rows: Any, entry: dict[str, Any] | None = None, file_name: str | None = None
) -> Path:
    """Write rows to root/file_name (json unless the name says otherwise) and register them."""
    root.mkdir(parents=True, exist_ok=True)
    file_name = file_name or f"{name}.json"
    path = root / file_name
    if file_name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif file_name.endswith(".txt"):
        path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    else:
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    info_path = root / "dataset_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    info[name] = {"file_name": file_name, **(entry or {})}
    info_path.write_text(json.dumps(info), encoding="utf-8")
    return path


def _alpaca_rows(n: int, prefix: str = "q") -> list[dict[str, str]]:
    return [
        {"instruction": f"{prefix} question {i}", "input": "", "output": f"answer number {i}."}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def bare(tokenizer):
    """The built-in tokenizer without a chat template, as a base model's would be (a copy per test module)."""
    out = copy.deepcopy(tokenizer)
    out.chat_template = None
    return out


@pytest.fixture
def make_cfg():
    return _make_cfg


@pytest.fixture
def write_dataset():
    return _write_dataset


@pytest.fixture
def alpaca_rows():
    return _alpaca_rows
