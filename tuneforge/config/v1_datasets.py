"""LlamaFactory v1's `train_dataset` / `eval_dataset`: a dataset-spec YAML (name: {path, source, split, converter,
size, weight, streaming}) or one local data file, read into checked entries.

Relative paths are read as v1 reads them, from the working folder; one that is not found there is tried from the
spec file's folder. The data layer (tuneforge.data.v1) turns the entries into datasets; the config layer only asks
whether the rows are preference pairs, to choose the stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tuneforge.errors import DataError

SPEC_SUFFIXES = (".yaml", ".yml")
SOURCES = ("hf_hub", "local")
CONVERTERS = ("alpaca", "sharegpt", "pair")
ENTRY_KEYS = ("path", "source", "split", "converter", "size", "weight", "streaming")
PAIR_COLUMNS = ("chosen_messages", "rejected_messages")


DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt")


def is_v1_dataset(name: str) -> bool:
    """Whether a `dataset` value names a v1 spec YAML or a data file (a dataset_info.json name wins over a file)."""
    return name.endswith(SPEC_SUFFIXES) or (name.endswith(DATA_SUFFIXES) and Path(name).is_file())


def _found(path: str, spec_dir: Path | None) -> str:
    if Path(path).is_absolute() or Path(path).exists() or spec_dir is None:
        return str(Path(path).resolve()) if Path(path).exists() else path
    beside = spec_dir / path
    return str(beside.resolve()) if beside.exists() else path


def read_spec(name: str) -> dict[str, dict[str, Any]]:
    """name -> checked entry (local paths resolved) of a spec YAML, or {"default": ...} for a data file."""
    path = Path(name)
    if not name.endswith(SPEC_SUFFIXES):
        if not path.exists():
            raise DataError(f"dataset {name} does not exist")
        return {path.stem: {"path": str(path.resolve()), "source": "local", "split": "train"}}
    if not path.is_file():
        raise DataError(f"dataset spec {name} does not exist (relative paths start at the working folder); a spec "
                        f"on the hub is not fetched: download it")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise DataError(f"dataset spec {name} is not valid YAML: {e}") from None
    if not isinstance(spec, dict) or not spec:
        raise DataError(f"dataset spec {name} must map dataset names to {{path: ..., source: ..., converter: ...}}")
    return {str(n): _entry(name, str(n), e, path.parent) for n, e in spec.items()}


def _entry(spec: str, name: str, entry: Any, spec_dir: Path) -> dict[str, Any]:
    where = f"dataset spec {spec}, dataset '{name}'"
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise DataError(f"{where}: must be a mapping with a path (e.g. {{path: data/rows.jsonl, source: local}})")
    unknown = [k for k in entry if k not in ENTRY_KEYS]
    if unknown:
        raise DataError(f"{where}: unknown key '{unknown[0]}' (v1's keys: {', '.join(ENTRY_KEYS)})")
    out = {"source": "hf_hub", "split": "train", **entry}
    if out["source"] not in SOURCES:
        raise DataError(f"{where}: source {out['source']!r} is not read by tuneforge; use local (download it) or "
                        f"hf_hub")
    if out.get("converter") is not None and out["converter"] not in CONVERTERS:
        raise DataError(f"{where}: converter {out['converter']!r} is not one of {', '.join(CONVERTERS)}")
    if out.get("streaming"):
        raise DataError(f"{where}: streaming is not supported for v1 datasets yet; remove it")
    if out.get("weight") is not None and float(out["weight"]) != 1.0:
        raise DataError(f"{where}: weight {out['weight']} (resampling by a factor) is not supported; set size (the "
                        f"number of rows to draw) instead")
    size = out.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        raise DataError(f"{where}: size must be a positive integer, got {size!r}")
    if out["source"] == "local":
        out["path"] = _found(out["path"], spec_dir)
        if not Path(out["path"]).exists():
            raise DataError(f"{where}: {entry['path']} does not exist (looked in the working folder and beside "
                            f"the spec)")
    return out


def first_row(path: str) -> dict[str, Any] | None:
    """The first row of a local .jsonl / .json file (None for other types or an empty file)."""
    file = Path(path)
    if file.is_dir() or file.suffix not in (".json", ".jsonl"):
        return None
    with file.open(encoding="utf-8") as f:
        if file.suffix == ".jsonl":
            line = next((line for line in f if line.strip()), None)
            return json.loads(line) if line else None
        rows = json.load(f)
    return rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else None


def entry_holds_pairs(entry: dict[str, Any]) -> bool:
    if entry.get("converter") == "pair":
        return True
    if entry.get("converter") is None and entry["source"] == "local":
        row = first_row(entry["path"])
        return row is not None and all(c in row for c in PAIR_COLUMNS)
    return False


def holds_pairs(name: str) -> bool:
    """Whether a v1 train_dataset's rows are preference pairs (converter pair, or chosen/rejected_messages rows)."""
    try:
        entries = read_spec(name)
    except (DataError, OSError, json.JSONDecodeError):
        return False  # the data build reports it, with the dataset named
    return any(entry_holds_pairs(e) for e in entries.values())
