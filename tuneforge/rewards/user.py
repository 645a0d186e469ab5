"""A user's own reward function, named in reward_funcs as `module:function` or `path/to/file.py:function`.

It is called TRL-style: function(prompts=..., completions=..., completion_ids=..., **columns), each a list
over the completions (a column as the list of its values), and returns one float or None per completion.
A function without **kwargs gets only the arguments it names.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from tuneforge.errors import ConfigError, TrainingError
from tuneforge.rewards.inputs import RewardInputs

FIXED_ARGUMENTS = ("prompts", "completions", "completion_ids")
FORMS = "module:function (an importable module) or path/to/file.py:function"


def is_user_entry(entry: str) -> bool:
    """A reward_funcs entry that names a function of the user's (built-in names have no colon)."""
    return ":" in entry


def load_function(entry: str, *, source: str) -> Callable[..., Any]:
    """The function entry names; ConfigError (key reward_funcs) naming the entry when it cannot be had."""
    target, _, name = entry.rpartition(":")
    if not target or not name:
        raise _error(source, entry, f"write it as {FORMS}")
    module = _load_file(entry, target, source) if _is_file(target) else _import(entry, target, source)
    found: Any = module
    for part in name.split("."):  # module:Class.method works too
        if not hasattr(found, part):
            raise _error(source, entry, f"{target} has no attribute '{part}'")
        found = getattr(found, part)
    if not callable(found):
        raise _error(source, entry, f"{target}:{name} is not a function (its type: {type(found).__name__})")
    return found


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_file(entry: str, target: str, source: str) -> ModuleType:
    path = Path(target).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if not path.is_file():
        raise _error(source, entry, f"there is no file {path} (a relative path starts at the working directory, "
                                    f"{Path.cwd()})")
    # a name of its own per file, so two files called rewards.py do not replace each other
    module_name = f"tuneforge_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise _error(source, entry, f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise _error(source, entry, f"running {path} failed: {type(e).__name__}: {e}") from e
    return module


def _import(entry: str, target: str, source: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise _error(source, entry, f"there is no module {e.name or target} to import ({e}); put its folder on "
                                    f"PYTHONPATH, install it, or write path/to/file.py:function") from e
    except Exception as e:
        raise _error(source, entry, f"importing {target} failed: {type(e).__name__}: {e}") from e


def _error(source: str, entry: str, why: str) -> ConfigError:
    return ConfigError(f"{source}: reward_funcs entry '{entry}': {why}", key="reward_funcs")


class UserReward:
    """entry's function as a function of RewardInputs; a raise becomes a TrainingError naming it."""

    def __init__(self, entry: str, function: Callable[..., Any]) -> None:
        self.entry, self.function = entry, function
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # no signature to read (some C functions): give it everything
            parameters = None
        self.takes_any = parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters)
        parameters = parameters or []
        self.named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.required = [p.name for p in parameters if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def arguments(self, inputs: RewardInputs) -> dict[str, Any]:
        given = {name: inputs.column(name) for name in inputs.column_names() if name not in FIXED_ARGUMENTS}
        given.update(prompts=inputs.prompts, completions=inputs.completions, completion_ids=inputs.completion_ids)
        missing = [name for name in self.required if name not in given]
        if missing:
            raise TrainingError(
                f"reward function {self.entry} (reward_funcs) takes {', '.join(missing)}, which is neither one of "
                f"{', '.join(FIXED_ARGUMENTS)} nor a dataset column (the columns: "
                f"{', '.join(inputs.column_names()) or 'none'}); rename the parameter or give it a default")
        return given if self.takes_any else {k: v for k, v in given.items() if k in self.named}

    def __call__(self, inputs: RewardInputs) -> Sequence[Any]:
        arguments = self.arguments(inputs)
        try:
            return self.function(**arguments)
        except Exception as e:
            raise TrainingError(f"reward function {self.entry} (reward_funcs) failed on a batch of "
                                f"{len(inputs.completions)} completions: {type(e).__name__}: {e}") from e
