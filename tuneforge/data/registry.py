"""dataset_info.json (LlamaFactory's format): dataset names -> where the rows are and how to read them."""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.errors import DataError
from tuneforge.flags import env_flag

logger = logging.getLogger(__name__)

DATA_CONFIG = "dataset_info.json"
FILE_TYPES = {
    "arrow": "arrow",
    "csv": "csv",
    "json": "json",
    "jsonl": "json",
    "parquet": "parquet",
    "txt": "text",
}
FORMATTINGS = ("alpaca", "sharegpt", "openai")
MEDIA_COLUMNS = ("images", "videos", "audios")
ALPACA_COLUMNS = ("prompt", "query", "response", "history")
COMMON_COLUMNS = ("system", "tools", "chosen", "rejected", "kto_tag") + MEDIA_COLUMNS
TAG_NAMES = (
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "observation_tag",
    "function_tag",
    "system_tag",
)
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
OPENAI_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function",
    "system_tag": "system",
}
HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url")


@dataclass
class DatasetAttr:
    """One entry of dataset_info.json. Column and tag values name columns / role strings in the raw rows."""

    name: str
    load_from: str  # file | hf_hub | ms_hub | om_hub | script | cloud_file
    source: str  # the file_name, hub id, script_url or cloud_file_name
    formatting: str = "alpaca"
    ranking: bool = False
    subset: str | None = None
    split: str = "train"
    folder: str | None = None
    num_samples: int | None = None
    revision: str | None = None
    columns: dict[str, str | None] = field(default_factory=dict)
    tags: dict[str, str | None] = field(default_factory=dict)
    entry: dict[str, Any] = field(default_factory=dict)  # the raw entry, for the cache key

    def column(self, key: str) -> str | None:
        return self.columns.get(key)

    @property
    def kind(self) -> str:
        """What the rows hold: `pairwise` (chosen/rejected), `feedback` (kto_tag) or `plain`."""
        if self.ranking:
            return "pairwise"
        if self.column("kto_tag"):
            return "feedback"
        return "plain"

    @property
    def media_columns(self) -> list[str]:
        return [k for k in MEDIA_COLUMNS if self.column(k)]


def read_dataset_info(dataset_dir: str | Path) -> dict[str, Any]:
    path = Path(dataset_dir) / DATA_CONFIG
    if not path.is_file():
        raise DataError(
            f"{path} does not exist; set dataset_dir to the folder that holds {DATA_CONFIG} "
            f'(LlamaFactory\'s format: {{"name": {{"file_name": "rows.json"}}}})'
        )
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise DataError(
            f"{path} must hold a mapping of dataset name -> description, not {type(info).__name__}"
        )
    return info


def _location(name: str, entry: dict[str, Any]) -> tuple[str, str]:
    """(load_from, source), preferring the Hugging Face hub over ModelScope / Modelers like LlamaFactory."""
    if any(k in entry for k in HUB_KEYS):
        if "hf_hub_url" in entry:
            return "hf_hub", entry["hf_hub_url"]
        key = "ms_hub_url" if "ms_hub_url" in entry else "om_hub_url"
        return key[:6], entry[key]
    for key, load_from in (
        ("script_url", "script"),
        ("cloud_file_name", "cloud_file"),
        ("file_name", "file"),
    ):
        if key in entry:
            return load_from, entry[key]
    raise DataError(
        f"{DATA_CONFIG}: dataset '{name}' has none of file_name, hf_hub_url, ms_hub_url, "
        f"om_hub_url, script_url, cloud_file_name; add file_name"
    )


def parse_entry(name: str, entry: Any) -> DatasetAttr:
    """One dataset_info.json entry -> DatasetAttr, with LlamaFactory's defaults."""
    if not isinstance(entry, dict):
        raise DataError(f"{DATA_CONFIG}: dataset '{name}' must be a mapping, not {type(entry).__name__}")
    load_from, source = _location(name, entry)
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise DataError(
            f"{DATA_CONFIG}: dataset '{name}' has formatting '{formatting}'; "
            f"use one of {', '.join(FORMATTINGS)}"
        )
    attr = DatasetAttr(
        name=name,
        load_from=load_from,
        source=str(source),
        formatting=formatting,
        ranking=bool(entry.get("ranking", False)),
        subset=entry.get("subset"),
        split=entry.get("split", "train"),
        folder=entry.get("folder"),
        num_samples=entry.get("num_samples"),
        revision=entry.get("revision"),
        entry=entry,
    )
    attr.columns = _columns(name, formatting, entry.get("columns"))
    attr.tags = _tags(name, formatting, entry.get("tags"))
    if attr.num_samples is not None and (not isinstance(attr.num_samples, int) or attr.num_samples <= 0):
        raise DataError(f"{DATA_CONFIG}: dataset '{name}': num_samples must be a positive integer")
    return attr


def _columns(name: str, formatting: str, given: Any) -> dict[str, str | None]:
    # As in LlamaFactory: without "columns" the defaults apply; with it, unnamed columns are unused.
    if formatting == "alpaca":
        names = ALPACA_COLUMNS + COMMON_COLUMNS
        defaults = {"prompt": "instruction", "query": "input", "response": "output"}
    else:
        names = ("messages",) + COMMON_COLUMNS
        defaults = {"messages": "conversations" if formatting == "sharegpt" else "messages"}
    if given is None:
        return {k: defaults.get(k) for k in names}
    if not isinstance(given, dict):
        raise DataError(
            f'{DATA_CONFIG}: dataset \'{name}\': columns must be a mapping such as {{"prompt": "text"}}'
        )
    columns = {k: given.get(k) for k in names}
    if formatting != "alpaca" and not columns["messages"]:
        columns["messages"] = defaults["messages"]
    return columns


def _tags(name: str, formatting: str, given: Any) -> dict[str, str | None]:
    defaults = OPENAI_TAGS if formatting == "openai" else SHAREGPT_TAGS
    if given is None:
        return dict(defaults)
    if not isinstance(given, dict):
        raise DataError(
            f'{DATA_CONFIG}: dataset \'{name}\': tags must be a mapping such as {{"role_tag": "role"}}'
        )
    tags = {k: given.get(k) for k in TAG_NAMES}
    # role and content tags cannot be left out; LlamaFactory would crash, we take the defaults
    for key in ("role_tag", "content_tag"):
        tags[key] = tags[key] or defaults[key]
    return tags


def get_dataset_attrs(names: list[str] | None, dataset_dir: str | Path) -> list[DatasetAttr]:
    """The DatasetAttr of each name, or a DataError that lists close names.

    A name that is a LlamaFactory v1 dataset-spec YAML or a data file (a v1 config's train_dataset) stands for the
    datasets it describes (tuneforge.data.v1)."""
    if not names:
        return []
    from tuneforge.config.v1_datasets import is_v1_dataset

    info = read_dataset_info(dataset_dir) if not all(is_v1_dataset(n) for n in names) else {}
    attrs = []
    for name in names:
        if name not in info and is_v1_dataset(name):
            from tuneforge.data import v1

            attrs += v1.dataset_attrs(name)
            continue
        if name not in info:
            close = difflib.get_close_matches(name, list(info), n=3, cutoff=0.5)
            hint = (
                f"did you mean {', '.join(repr(c) for c in close)}?"
                if close
                else f"it has {len(info)} entries, e.g. {', '.join(list(info)[:5])}"
            )
            raise DataError(f"dataset '{name}' is not in {Path(dataset_dir) / DATA_CONFIG}; {hint}")
        attrs.append(parse_entry(name, info[name]))
    return attrs


def local_files(attr: DatasetAttr, dataset_dir: str | Path) -> list[Path]:
    """The data files of a file dataset: the file itself, or every file of the folder (sorted)."""
    path = Path(dataset_dir) / attr.source
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"dataset '{attr.name}': folder {path} holds no files")
        return files
    raise DataError(
        f"dataset '{attr.name}': {path} does not exist (file_name '{attr.source}' is read "
        f"relative to dataset_dir {dataset_dir})"
    )


def file_type(attr: DatasetAttr, files: list[Path]) -> str:
    types = {FILE_TYPES.get(p.suffix.lower().lstrip(".")) for p in files}
    if None in types:
        bad = next(p for p in files if FILE_TYPES.get(p.suffix.lower().lstrip(".")) is None)
        raise DataError(
            f"dataset '{attr.name}': {bad} has an unknown file type; use one of "
            f"{', '.join('.' + e for e in FILE_TYPES)}"
        )
    if len(types) > 1:
        raise DataError(f"dataset '{attr.name}': the folder mixes file types {sorted(types)}; keep one type")
    return types.pop()


def _hub_offline() -> bool:
    return env_flag("HF_HUB_OFFLINE")


def load_raw(attr: DatasetAttr, dataset_dir: str | Path, *, cache_dir: str | None = None):
    """The raw rows of one dataset as a `datasets.Dataset`."""
    import datasets

    if attr.load_from == "file":
        files = local_files(attr, dataset_dir)
        builder = file_type(attr, files)
        try:
            ds = datasets.load_dataset(
                builder, data_files=[str(p) for p in files], split="train", cache_dir=cache_dir
            )
        except Exception as e:  # datasets raises many kinds for a malformed file
            raise DataError(
                f"dataset '{attr.name}': cannot read {', '.join(map(str, files))} as {builder}: {e}"
            ) from None
    elif attr.load_from == "hf_hub":
        ds = _load_hub(attr, cache_dir)
    elif attr.load_from == "script":
        ds = _load_script_folder(attr, dataset_dir, cache_dir)
    elif attr.load_from == "cloud_file":
        raise DataError(
            f"dataset '{attr.name}': cloud_file_name ({attr.source}) is not supported yet; "
            f"download the file into dataset_dir and use file_name"
        )
    else:
        hub = "ModelScope" if attr.load_from == "ms_hub" else "Modelers"
        raise DataError(
            f"dataset '{attr.name}' is only on the {hub} hub ({attr.source}), which tuneforge "
            f"does not read; download it into dataset_dir and use file_name"
        )
    if len(ds) == 0:
        raise DataError(f"dataset '{attr.name}' ({attr.source}) has no rows")
    return ds


def _load_hub(attr: DatasetAttr, cache_dir: str | None):
    import datasets

    try:
        return datasets.load_dataset(
            attr.source,
            name=attr.subset,
            data_dir=attr.folder,
            split=attr.split,
            revision=attr.revision,
            cache_dir=cache_dir,
        )
    except Exception as e:
        if _hub_offline():
            raise DataError(
                f"dataset '{attr.name}' comes from the hub ({attr.source}) and is not available "
                f"offline (HF_HUB_OFFLINE=1) nor in the local datasets cache; unset HF_HUB_OFFLINE "
                f"or download it and use {'its local path (source: local)' if attr.entry.get('v1') else 'file_name'}"
            ) from None
        raise DataError(f"dataset '{attr.name}': cannot load {attr.source} from the hub: {e}") from None


def _load_script_folder(attr: DatasetAttr, dataset_dir: str | Path, cache_dir: str | None):
    import datasets

    path = Path(dataset_dir) / attr.source
    if not path.is_dir():
        raise DataError(
            f"dataset '{attr.name}': script_url {path} is not a folder of data files; loading "
            f"scripts are not supported by datasets >= 4 — convert it to json/parquet files"
        )
    try:
        return datasets.load_dataset(
            str(path), name=attr.subset, data_dir=attr.folder, split=attr.split, cache_dir=cache_dir
        )
    except Exception as e:
        raise DataError(f"dataset '{attr.name}': cannot load the folder {path}: {e}") from None
