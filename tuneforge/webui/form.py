"""The training form, derived from the config schema (no second hand-written list of keys).

Every key of `config.schema` is one field: a checkbox for a boolean, a dropdown for a key with choices, a text box
for the rest, holding the value as it would be written after `key=` on the command line (`1e-4`, `a,b`, `null`).
`to_form` turns a config mapping (ours, or a LlamaFactory / LlamaBoard file) into field values and `from_form` turns
field values back into the mapping a YAML file holds: the keys that differ from their defaults. `check` validates
that mapping with the CLI's own validation and sorts its error onto the field it names.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

import yaml

from tuneforge.config import from_dict, llamafactory_v1
from tuneforge.config.loader import coerce, current_names, foreign_key, read_file
from tuneforge.config.schema import RunConfig, key_index, key_types
from tuneforge.errors import ConfigError, TuneforgeError

# shown first, above the groups: what a run needs before anything else
BASIC_KEYS = ("model_name_or_path", "adapter_name_or_path", "finetuning_type", "stage", "dataset_dir", "dataset",
              "eval_dataset", "output_dir", "learning_rate", "num_train_epochs", "max_steps",
              "per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len", "lora_rank", "bf16")
NULL = "null"  # a dropdown's entry for "no value"


@dataclass(frozen=True)
class FieldSpec:
    """One config key as a form field."""

    key: str
    group: str
    kind: str  # "bool", "choice" or "text"
    default: Any  # the form value of the key's default
    help: str
    choices: tuple[str, ...] = ()


def _default(f: Any) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def _is_bool(tp: Any) -> bool:
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return bool in options and all(o in (bool, type(None)) for o in options)


@functools.cache
def field_specs() -> tuple[FieldSpec, ...]:
    """Every key of the schema, in the schema's order, grouped as the schema groups them (computed once)."""
    types_of = key_types()
    specs = []
    for key, (group, f) in key_index().items():
        tp, choices = types_of[key], f.metadata.get("choices")
        if choices is not None:
            spec = FieldSpec(key, group, "choice", _choice_text(_default(f)), f.metadata.get("help", ""),
                             tuple(_choice_text(c) for c in choices))
        elif _is_bool(tp):
            spec = FieldSpec(key, group, "bool", bool(_default(f)), f.metadata.get("help", ""))
        else:
            spec = FieldSpec(key, group, "text", value_text(_default(f)), f.metadata.get("help", ""))
        specs.append(spec)
    return tuple(specs)


def _choice_text(value: Any) -> str:
    return NULL if value is None else str(value)


def value_text(value: Any) -> str:
    """A value as typed after `key=`: lists comma-separated, mappings as JSON, None as empty."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(value_text(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def read_config(path: str) -> dict[str, Any]:
    """The flat keys of a config file: ours, LlamaFactory's or LlamaBoard's, a LlamaFactory v1 file's flattened."""
    raw = read_file(path)
    return llamafactory_v1.flatten(raw, path) if llamafactory_v1.is_v1(raw) else raw


def to_form(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A config mapping -> (field values for every key, errors by key for values the form cannot hold). A key the
    schema does not know is left out: silently when the CLI accepts and ignores it (a LlamaFactory key that changes
    nothing here), else reported under its own name with the CLI's message."""
    specs = {s.key: s for s in field_specs()}
    values = {key: spec.default for key, spec in specs.items()}
    errors: dict[str, str] = {}
    types_of = key_types()
    for key, value in current_names(raw, "the file").items():
        spec = specs.get(key)
        if spec is None:
            problem = foreign_key(key, value)
            if problem is not None:
                errors[key] = problem
            continue
        try:
            typed = coerce(key, value, types_of[key])
        except ConfigError as e:
            errors[key] = str(e)
            continue
        if spec.kind == "bool":
            values[key] = bool(typed)
        elif spec.kind == "choice":
            values[key] = _choice_text(typed)
        else:
            values[key] = value_text(typed)
    return values, errors


def from_form(values: dict[str, Any]) -> dict[str, Any]:
    """Field values -> the config mapping a YAML file holds: each key whose value differs from its default, parsed
    as the command line parses `key=value` and typed as the schema types it (a value of the wrong type is kept as
    written, for `check` to name)."""
    raw: dict[str, Any] = {}
    types_of = key_types()
    for spec in field_specs():
        if spec.key not in values:
            continue
        value = values[spec.key]
        if spec.kind == "bool":
            if bool(value) != spec.default:
                raw[spec.key] = bool(value)
            continue
        text = "" if value is None else str(value).strip()
        if text == str(spec.default).strip():
            continue
        if spec.kind == "choice":
            raw[spec.key] = None if text == NULL else yaml.safe_load(text) if text.isdigit() else text
        else:
            parsed = _parsed(text)
            try:
                raw[spec.key] = coerce(spec.key, parsed, types_of[spec.key])
            except ConfigError:
                raw[spec.key] = parsed
    return raw


def _parsed(text: str) -> Any:
    if not text:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def check(raw: dict[str, Any], *, for_training: bool = True) -> tuple[RunConfig | None, dict[str, str], str]:
    """Validate a mapping as the CLI does: (the config or None, the error by key it names, an error that names no
    key)."""
    try:
        return from_dict(dict(raw), source="the form", for_training=for_training), {}, ""
    except ConfigError as e:
        message = str(e)
        return None, ({key: message for key in e.keys} if e.keys else {}), "" if e.keys else message
    except TuneforgeError as e:
        return None, {}, str(e)


def to_yaml(raw: dict[str, Any]) -> str:
    """The mapping as the YAML file `tuneforge train` runs (keys in the schema's order)."""
    order = {key: i for i, key in enumerate(key_index())}
    ordered = dict(sorted(raw.items(), key=lambda item: order.get(item[0], len(order))))
    return yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True)
