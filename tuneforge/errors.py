"""Errors a user can cause. Each message names the file, row, key or value and what to do."""


class TuneforgeError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(TuneforgeError):
    """A config key, value or combination that cannot work."""


class DataError(TuneforgeError):
    """A dataset, file or row that cannot be used."""


class ModelError(TuneforgeError):
    """A model that cannot be found or loaded as asked."""


class TrainingError(TuneforgeError):
    """Training cannot go on (a NaN loss, a checkpoint that does not match)."""
