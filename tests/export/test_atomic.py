"""export_dir is written atomically: a failure halfway leaves the previous export (or nothing) and no
temporary folder; a killed export's leftover is cleaned by the next one."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from export_helpers import siblings

from tuneforge.atomic import atomic_folder, remove_stale_partials
from tuneforge.export import export_model


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _boom(*args, **kwargs):
    raise RuntimeError("disk full")


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_while_writing_keeps_the_previous_export(make_cfg, monkeypatch, error):
    from tuneforge.export import hf

    cfg = make_cfg()
    out = Path(cfg.export.export_dir)
    export_model(cfg)
    before = _digest(out)

    def fail_after_weights(*args, **kwargs):  # the weights are already in the temporary folder
        raise error("disk full")

    monkeypatch.setattr(hf, "save_tokenizer", fail_after_weights)
    with pytest.raises(error):
        export_model(make_cfg(temperature=0.1))
    assert _digest(out) == before
    assert siblings(out) == []


def test_failure_on_first_export_leaves_nothing(make_cfg, monkeypatch):
    from tuneforge.export import hf

    cfg = make_cfg()
    monkeypatch.setattr(hf, "save_tokenizer", _boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(cfg)
    out = Path(cfg.export.export_dir)
    assert not out.exists() and siblings(out) == []


def test_replacing_swaps_in_the_new_folder_whole(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_folder(target) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (target / "old.txt").exists()  # the old export stays readable until the new one is complete
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert siblings(target) == []


def test_leftover_of_a_killed_export_is_removed(tmp_path):
    target = tmp_path / "model"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".model.partial-{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    mine = tmp_path / ".model.partial-1-running"  # pid 1 is alive: never touched
    mine.mkdir()
    assert remove_stale_partials(target) == [stale]
    assert not stale.exists() and mine.exists()


def test_exported_files_are_readable_like_ordinary_files(tmp_path):
    import os
    import stat

    target = tmp_path / "model"
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"w")
        os.chmod(tmp / "weights", 0o600)  # as safetensors writes its files
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((target / "weights").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~mask


def test_keep_existing_keeps_what_another_process_finished_first(tmp_path):
    """The tokenized-data cache and the built-in model: two processes building the same entry keep the first."""
    target = tmp_path / "entry"
    with atomic_folder(target, keep_existing=True) as tmp:
        (tmp / "theirs").write_text("first")
        with atomic_folder(target, keep_existing=True) as other:  # finishes while the first is still writing
            (other / "mine").write_text("second")
    assert sorted(p.name for p in target.iterdir()) == ["mine"]  # the first to finish stays
    assert siblings(target) == []
