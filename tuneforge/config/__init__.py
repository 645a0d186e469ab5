"""Configuration: one typed, validated RunConfig from a YAML/JSON file and `key=value` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneforge.config import llamafactory_v1
from tuneforge.config.loader import build, parse_overrides, read_file
from tuneforge.config.schema import DataArgs, MethodArgs, ModelArgs, RunConfig, TrainArgs
from tuneforge.config.validate import checkpoints_in, validate

__all__ = [
    "DataArgs", "MethodArgs", "ModelArgs", "RunConfig", "TrainArgs",
    "checkpoints_in", "load", "from_dict",
]


def from_dict(raw: dict[str, Any], *, source: str = "<dict>", for_training: bool = True) -> RunConfig:
    """A validated RunConfig from a flat mapping (as written in YAML)."""
    cfg = build(raw, source)
    validate(cfg, for_training=for_training)
    return cfg


def load(path: str | Path | None, overrides: list[str] | None = None, *, for_training: bool = True) -> RunConfig:
    """Read a config file, apply `key=value` overrides, and validate the result.

    A LlamaFactory v1 file (nested model / peft_config / dist_config ...) is flattened after its overrides, which
    may then use v1's names and dotted plugin keys (peft_config.r=16)."""
    raw = read_file(path) if path is not None else {}
    source = str(path) if path is not None else "<overrides>"
    if llamafactory_v1.is_v1(raw):
        flat = llamafactory_v1.flatten(llamafactory_v1.with_overrides(raw, parse_overrides(overrides or [])), source)
        cfg = build(flat, source)
        llamafactory_v1.fit_processes(cfg)
        validate(cfg, for_training=for_training)
        return cfg
    raw.update(parse_overrides(overrides or []))
    return from_dict(raw, source=source, for_training=for_training)
