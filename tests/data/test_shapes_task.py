"""The project's own image demo (scripts/make_shapes_task.py): committed, registered, reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from tuneforge.data import registry

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"


def test_the_committed_files_are_what_the_script_writes(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shapes_task.py"), "--out-dir", str(tmp_path)],
                   check=True)
    for name in ("shapes_train", "shapes_test"):
        assert json.loads((tmp_path / f"{name}.json").read_text()) == json.loads((DATA / f"{name}.json").read_text())
    written = sorted((tmp_path / "shapes").iterdir())
    assert [p.name for p in written] == sorted(p.name for p in (DATA / "shapes").iterdir())
    for path in written:
        assert np.array_equal(np.asarray(Image.open(path)), np.asarray(Image.open(DATA / "shapes" / path.name)))


def test_every_row_names_one_existing_picture_with_one_placeholder():
    attrs = {a.name: a for a in registry.get_dataset_attrs(["shapes_train", "shapes_test"], DATA)}
    for name, attr in attrs.items():
        assert attr.media_columns == ["images"]
        for row in json.loads((DATA / f"{name}.json").read_text()):
            assert len(row["images"]) == 1 and (DATA / row["images"][0]).is_file()
            assert sum(m["content"].count("<image>") for m in row["messages"]) == 1
    train = {r["images"][0] for r in json.loads((DATA / "shapes_train.json").read_text())}
    test = {r["images"][0] for r in json.loads((DATA / "shapes_test.json").read_text())}
    assert not train & test
