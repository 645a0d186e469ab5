"""Errors a user can cause. Each message names the file, row, key or value and what to do."""

from __future__ import annotations


class TuneforgeError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(TuneforgeError):
    """A config key, value or combination that cannot work.

    keys: the config keys at fault, as data (a form points at those fields); empty when the fault is not one
    key's (a missing file, an environment variable)."""

    def __init__(self, message: str, *, key: str | tuple[str, ...] | list[str] | None = None) -> None:
        super().__init__(message)
        self.keys: tuple[str, ...] = (key,) if isinstance(key, str) else tuple(key or ())

    @property
    def key(self) -> str | None:
        """The first key at fault, if any."""
        return self.keys[0] if self.keys else None


class DataError(TuneforgeError):
    """A dataset, file or row that cannot be used."""


class ModelError(TuneforgeError):
    """A model that cannot be found or loaded as asked."""


class TrainingError(TuneforgeError):
    """Training cannot go on (a NaN loss, a checkpoint that does not match)."""


class HubError(TuneforgeError):
    """An upload to the Hugging Face hub failed (the local files are complete and stay where they are)."""
