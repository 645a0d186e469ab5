"""The tokenized-data cache: keys from file contents and the tokenizer, atomic writes, loading back.

A cache entry (and a tokenized_path folder) is a `datasets.DatasetDict` saved with save_to_disk
(splits train / eval) plus stats.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tuneforge.atomic import atomic_folder
from tuneforge.data import registry
from tuneforge.data.registry import DatasetAttr
from tuneforge.errors import DataError

CACHE_VERSION = 1  # bump when the encoding of the same inputs changes
STATS_FILE = "stats.json"
MEDIA_FILE = "media_files.json"  # the local media files the rows were rendered from: (path, size, mtime_ns)
SPLITS = ("train", "eval")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dataset_identity(attr: DatasetAttr, dataset_dir: str) -> dict[str, Any]:
    """What a dataset's rows depend on: its dataset_info entry and, for files, their contents.

    Hub datasets are known by id, split and revision only; set overwrite_cache after they change.
    """
    identity: dict[str, Any] = {"name": attr.name, "entry": attr.entry}
    if attr.load_from in ("file", "script"):
        root = Path(dataset_dir) / attr.source
        files = (
            registry.local_files(attr, dataset_dir)
            if attr.load_from == "file"
            else sorted(p for p in root.rglob("*") if p.is_file())
        )
        identity["files"] = [(str(p.relative_to(dataset_dir)) if p.is_relative_to(dataset_dir) else str(p),
                              _sha256_file(p)) for p in files]
    return identity


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary and rules (its tokenizer.json) and special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def save_splits(splits: dict[str, Any], stats: dict[str, Any], target: Path, *, replace: bool,
                media_files: list[Path] | None = None) -> None:
    """Write splits + stats (+ the media files' manifest) to a temporary folder beside `target`, then rename it
    into place.

    Without `replace`, a `target` that appeared meanwhile (another process built the same key) is kept.
    """
    import datasets

    with atomic_folder(target, keep_existing=not replace) as tmp:
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
        (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2, default=str), encoding="utf-8")
        if media_files:
            (tmp / MEDIA_FILE).write_text(json.dumps([_file_state(p) for p in media_files]), encoding="utf-8")


def _file_state(path: Path) -> list[Any]:
    info = path.stat()
    return [str(path), info.st_size, info.st_mtime_ns]


def changed_media(entry: Path) -> str | None:
    """The first media file a cached build was rendered from that changed since (its size or modification time);
    None when all are as they were (or the build had none). The cache key covers the data files, not every image
    they name: this check on each hit covers those. A file that is gone is not a change: the cached rows hold
    what it was rendered into."""
    manifest = entry / MEDIA_FILE
    if not manifest.is_file():
        return None
    for path, size, mtime in json.loads(manifest.read_text(encoding="utf-8")):
        try:
            if _file_state(Path(path))[1:] != [size, mtime]:
                return path
        except OSError:
            continue
    return None


def load_splits(path: Path, *, cache_hit: bool) -> tuple[Any, Any, dict[str, Any]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(
            f"{path} is not a tokenized dataset folder ({e}); delete it or set overwrite_cache: true"
        ) from None
    if not isinstance(saved, datasets.DatasetDict):
        saved = datasets.DatasetDict({"train": saved})
    unknown = set(saved) - set(SPLITS)
    if unknown:
        raise DataError(f"{path} holds splits {sorted(saved)}; expected train and/or eval")
    stats_path = path / STATS_FILE
    stats = json.loads(stats_path.read_text(encoding="utf-8")) if stats_path.is_file() else {}
    stats["cache_hit"] = cache_hit
    stats["cache_dir"] = str(path)
    return saved.get("train"), saved.get("eval"), stats


def is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def processor_fingerprint(processor: Any) -> str:
    """sha256 of a processor's settings (its image / video / audio processors' configs) and chat template; the
    tokenizer is keyed on its own."""
    settings = processor.to_dict()
    settings.pop("tokenizer", None)
    h = hashlib.sha256(type(processor).__name__.encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(str(getattr(processor, "chat_template", "")).encode())
    return h.hexdigest()
