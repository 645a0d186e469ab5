"""Write a folder atomically: build it in a hidden sibling, then rename it into place.

A reader of export_dir sees either the previous export or the new one, never half of one: the new folder
is complete before it moves in; an existing export_dir is renamed aside, the new one renamed in, and only
then is the old one removed. An exception (Ctrl-C included) removes the temporary folder. A killed process
cannot clean up after itself: its hidden `.NAME.partial-PID-*` folder is removed by the next export to the
same place, once that PID is no longer running.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


def _partial_prefix(target: Path) -> str:
    return f".{target.name}.partial-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the temporary folders that killed exports to `target` left behind (their PID is gone)."""
    removed = []
    prefix = _partial_prefix(target)
    if not target.parent.is_dir():
        return removed
    for path in target.parent.iterdir():
        if not (path.name.startswith(prefix) and path.is_dir()):
            continue
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed %s, left by an export that was killed", path)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_modes(folder: Path) -> None:
    """Files get the mode a plain `open()` gives them (safetensors writes its files private, 0600)."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


@contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; on a clean exit it replaces `target` (with the
    folder's and its files' modes those of ordinary new files: the umask decides)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_partial_prefix(target)}{os.getpid()}-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the export is an ordinary folder
    try:
        yield tmp
        _default_modes(tmp)
        replace_folder(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_folder(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing `target` is set aside first and removed only afterwards."""
    if not target.exists():
        os.rename(new, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)  # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)
