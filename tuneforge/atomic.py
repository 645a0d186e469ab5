"""Write a folder atomically: build it in a hidden sibling, then rename it into place (every layer uses this).

Checkpoints, the final model's scratch folder, the tokenized-data cache, the converted built-in model and
export_dir are all written this way, with one failure behaviour:
- A reader of the target sees the previous folder or the new one, never half of one: the new folder is
  complete before it moves in; an existing target is renamed aside, the new one renamed in (the old one put
  back should that rename fail), and only then is the old one removed.
- An exception (Ctrl-C included) removes the temporary folder and leaves the target as it was.
- A killed process cannot clean up after itself: its hidden `.NAME.partial-PID-*` folder is removed by the next
  write to the same target once that PID is no longer running (and by `remove_partials` in a folder the
  caller owns, such as a run's output_dir at the start of the run).
- keep_existing: a target that exists once the new folder is complete (another process built the same cache
  entry meanwhile) is kept, and the new folder discarded.
Files and the folder get the modes ordinary new files get (the umask decides): safetensors writes its files
private (0600), which would surprise whoever shares an export or a cache.
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

PARTIAL = ".partial-"


def _partial_prefix(target: Path) -> str:
    return f".{target.name}{PARTIAL}"


def is_partial(path: Path) -> bool:
    """True for a temporary folder of an unfinished atomic write."""
    return path.name.startswith(".") and PARTIAL in path.name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _pid_of(path: Path) -> int | None:
    pid = path.name.split(PARTIAL, 1)[1].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _stale(path: Path) -> bool:
    pid = _pid_of(path)
    return pid is not None and pid != os.getpid() and not _alive(pid)


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the temporary folders that killed writes to `target` left behind (their PID is gone)."""
    removed = []
    prefix = _partial_prefix(target)
    if not target.parent.is_dir():
        return removed
    for path in target.parent.iterdir():
        if path.name.startswith(prefix) and path.is_dir() and _stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed %s, left by a write that was killed", path)
    return removed


def remove_partials(folder: Path) -> list[Path]:
    """Remove every stale temporary folder directly in `folder` (whatever its target)."""
    removed = []
    if folder.is_dir():
        for path in folder.iterdir():
            if is_partial(path) and path.is_dir() and _stale(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                logger.info("removed %s, left by an interrupted save", path)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_modes(folder: Path) -> None:
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def partial_folder(target: str | Path) -> Path:
    """A new, empty temporary folder beside `target`, named so that a killed writer's leftover is recognised."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_partial_prefix(target)}{os.getpid()}-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private
    return tmp


@contextmanager
def atomic_folder(target: str | Path, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; on a clean exit it replaces `target` (see the module
    docstring for what a failure leaves)."""
    target = Path(target)
    tmp = partial_folder(target)
    try:
        yield tmp
        _default_modes(tmp)
        if keep_existing and target.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            replace_folder(tmp, target, keep_existing=keep_existing)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_folder(new: Path, target: Path, *, keep_existing: bool = False) -> None:
    """Rename `new` to `target`; an existing `target` is set aside first and removed only afterwards."""
    if not target.exists():
        try:
            os.rename(new, target)
        except OSError:
            if not (keep_existing and target.exists()):  # another process got there first: theirs is kept
                raise
            shutil.rmtree(new, ignore_errors=True)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)  # put the previous folder back
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_file(path: str | Path, text: str) -> Path:
    """Write a text file atomically: a hidden temporary sibling, renamed over `path` (a reader sees the old file or
    the new one, never part of one), with the mode an ordinary new file gets."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
