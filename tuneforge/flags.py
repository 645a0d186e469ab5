"""On / off values, in config files, overrides and environment variables: one vocabulary everywhere."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

TRUE_WORDS = ("true", "yes", "on", "y", "1")
FALSE_WORDS = ("false", "no", "off", "n", "0")


def parse_flag(value: Any) -> bool | None:
    """True / False for a bool, 0 / 1 or one of the words above (any case, spaces ignored); None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return bool(value) if value in (0, 1) else None
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    return None


def env_flag(name: str, env: Mapping[str, str] = os.environ) -> bool:
    """A switch in the environment (FORCE_TORCHRUN=1, USE_RAY=true, HF_HUB_OFFLINE=1): unset or unreadable is off."""
    return parse_flag(env.get(name, "")) is True


def env_switch(name: str, error: type[Exception], env: Mapping[str, str] = os.environ) -> bool:
    """A switch that is on unless set off (TUNEFORGE_PACKED_LINEAR=0); a value neither on nor off raises error."""
    switch = parse_flag(env.get(name, "1"))
    if switch is None:
        raise error(f"{name}={env[name]!r} is not on or off; use 1 or 0 (true / false, yes / no)")
    return switch
