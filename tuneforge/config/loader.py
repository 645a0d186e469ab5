"""YAML / JSON file + `key=value` overrides -> a typed RunConfig, with errors that say what to change."""

from __future__ import annotations

import difflib
import json
import logging
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml

from tuneforge.config import llamafactory
from tuneforge.config.schema import GROUPS, RunConfig, key_index, key_types
from tuneforge.errors import ConfigError
from tuneforge.flags import env_flag, parse_flag

logger = logging.getLogger(__name__)


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML or JSON config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of key: value, not {type(data).__name__}")
    return data


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` strings -> {key: value}; values are parsed as YAML scalars (`true`, `1e-4`, `[a, b]`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. learning_rate=5e-5)")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            out[key] = value
    return out


def _suggest(key: str) -> str:
    known = list(key_index()) + list(llamafactory.IGNORED) + list(llamafactory.NOT_YET) + list(llamafactory.RENAMED)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" — did you mean '{close[0]}'?" if close else " (see the README's list of config keys)"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert `value` to the annotated type `tp`, or raise a ConfigError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        if isinstance(value, str) and value.strip().lower() in ("none", "null", "") and type(None) in options:
            return None
        errors = []
        # bool before str so that "true" becomes True for `bool | str` keys
        for option in sorted((o for o in options if o is not type(None)), key=lambda o: o is str):
            try:
                return coerce(key, value, option)
            except ConfigError as e:
                errors.append(str(e))
        accepted = " or ".join(_type_name(o) for o in options)
        raise ConfigError(f"key '{key}': {value!r} is not {accepted}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        return [coerce(key, v, item_tp) for v in value]
    if tp is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        if not isinstance(value, dict):
            raise ConfigError(f"key '{key}': expected a mapping such as {{min_lr_rate: 0.1}}, got {value!r}")
        return value
    if tp is bool:
        flag = parse_flag(value)
        if flag is not None:
            return flag
        raise ConfigError(f"key '{key}': expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"key '{key}': expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"key '{key}': expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"key '{key}': expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"key '{key}': expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"key '{key}': expected a string, got {value!r}")
        if isinstance(value, bool):  # YAML 1.1 reads `eval_strategy: no` (and off / false) as False
            return "yes" if value else "no"
        return str(value)
    raise AssertionError(f"unhandled type {tp} for {key}")


def _admits_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def foreign_key(key: str, value: Any) -> str | None:
    """For a key that is not in the schema: None when it is accepted and ignored (a LlamaFactory key that changes
    nothing here, or one tuneforge does not support yet at LlamaFactory's default value), else why it cannot be
    used."""
    if key in llamafactory.IGNORED:
        return None
    if key in llamafactory.REPLACED:
        return None if llamafactory.at_default(key, value) else f"key '{key}' {llamafactory.REPLACED[key][1]}"
    if key in llamafactory.NOT_YET:
        if llamafactory.at_default(key, value):
            return None
        return (f"LlamaFactory key '{key}' is not supported by tuneforge yet (only its default, "
                f"{_shown(llamafactory.NOT_YET[key])}, is accepted; got {value!r}); remove it from the config to "
                f"run without it")
    if env_flag("ALLOW_EXTRA_ARGS"):  # LlamaFactory's escape hatch for files that knowingly carry other keys
        logger.warning("unknown key '%s' ignored (ALLOW_EXTRA_ARGS is set)%s", key, _suggest(key))
        return None
    return f"unknown key '{key}'{_suggest(key)}"


def current_names(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The mapping with older key names (llamafactory.RENAMED) under their current ones."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        new = llamafactory.RENAMED.get(key)
        if new is None:
            out.setdefault(key, value)
            continue
        if new in raw and raw[new] != value:
            raise ConfigError(f"{source}: '{key}' is the older name of '{new}', and both are set to different values "
                              f"({value!r} and {raw[new]!r}); keep '{new}'", key=new)
        logger.info("%s: key '%s' is the older name of '%s'", source, key, new)
        out[new] = value
    return out


def _shown(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, (bool, list, dict)) else repr(value)


def build(raw: dict[str, Any], source: str = "<overrides>") -> RunConfig:
    """A RunConfig from a flat mapping; unknown, unsupported and ill-typed keys raise ConfigError."""
    index, types_of = key_index(), key_types()
    values: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    unknown: ConfigError | None = None  # raised last: a known key's problem says more about the file
    for key, value in current_names(raw, source).items():
        if key in index:
            group, f = index[key]
            if value is None and not _admits_none(types_of[key]):
                continue  # `key: null` (LlamaFactory's / transformers' way of writing "unset"): the default
            try:
                value = coerce(key, value, types_of[key])
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}", key=key) from None
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                why = f.metadata.get("refused", {}).get(value)
                if why is not None:
                    raise ConfigError(f"{source}: {key} {value} {why}", key=key)
                shown = ", ".join("null" if c is None else str(c) for c in choices)
                raise ConfigError(f"{source}: key '{key}': {value!r} is not one of {shown}", key=key)
            values[group][key] = value
        elif (problem := foreign_key(key, value)) is None:
            logger.debug("%s: key '%s' accepted and ignored (%r)", source, key, value)
        elif problem.startswith("unknown key"):
            unknown = unknown or ConfigError(f"{source}: {problem}", key=key)
        else:
            raise ConfigError(f"{source}: {problem}", key=key)
    if unknown is not None:
        raise unknown
    train = values["train"]
    if "do_train" not in train and (train.get("do_eval") or train.get("do_predict")):
        # LlamaFactory's do_train defaults to false: a file that asks only to evaluate or predict does just that
        train["do_train"] = False
        logger.info("%s: do_eval / do_predict set without do_train: evaluating, not training", source)
    groups = {g: cls(**values[g]) for g, cls in GROUPS.items()}
    return RunConfig(**groups, source=source)


def defaults() -> dict[str, Any]:
    """Every key with its default value, for documentation."""
    out = {}
    for cls in GROUPS.values():
        for f in fields(cls):
            out[f.name] = f.default if f.default is not MISSING else f.default_factory()
    return out
