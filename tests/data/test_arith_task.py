"""The project's own RL task (scripts/make_arith_task.py): committed, registered, held out, reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tuneforge.data import registry

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
SPLITS = ("arith_train", "arith_test")
ASK = "Give the final answer as a number on the last line."


def rows(name: str) -> list[dict]:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def test_splits_parse_and_every_answer_is_an_integer():
    for name in SPLITS:
        found = rows(name)
        assert found, name
        for row in found:
            assert set(row) == {"instruction", "answer"}
            assert row["instruction"].endswith(" " + ASK)
            assert row["answer"] == str(int(row["answer"])), row  # plain digits: no sign, spaces or leading zeros
        problems = [r["instruction"] for r in found]
        assert len(set(problems)) == len(problems), f"{name} repeats a problem"


def test_held_out_split_is_disjoint_from_training():
    train = {r["instruction"] for r in rows("arith_train")}
    assert not train & {r["instruction"] for r in rows("arith_test")}


def test_registered_as_prompt_datasets_whose_answer_column_passes_through(tmp_path):
    info = registry.read_dataset_info(DATA)
    for name in SPLITS:
        attr = registry.parse_entry(name, info[name])
        assert (attr.kind, attr.formatting) == ("plain", "alpaca")
        assert (attr.column("prompt"), attr.column("query"), attr.column("response")) == ("instruction", None, None)
        raw = registry.load_raw(attr, DATA, cache_dir=str(tmp_path))
        assert sorted(raw.column_names) == ["answer", "instruction"] and len(raw) == len(rows(name))


def test_generator_reproduces_the_committed_files(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_arith_task.py"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True)
    for name in SPLITS:
        assert (tmp_path / f"{name}.json").read_bytes() == (DATA / f"{name}.json").read_bytes(), name
