"""The reward keys' rules, checked before any data or model loads (config validation calls check_rewards),
and the data's, checked once the columns are known (required_columns). Imports no torch."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tuneforge.config.rl import resolved_rl
from tuneforge.errors import ConfigError
from tuneforge.rewards.builtin import BUILTINS, answer_column, overlong_buffer
from tuneforge.rewards.locate import check_reward_model_files
from tuneforge.rewards.server import is_http_url
from tuneforge.rewards.user import FORMS, is_user_entry, load_function
from tuneforge.stages import STAGES

if TYPE_CHECKING:
    from tuneforge.config.schema import RLArgs, RunConfig

MODEL_REWARD = "reward_model"


def reward_names(rl: RLArgs) -> list[str]:
    """One name per reward, in the order of reward_weights: reward_funcs as written, then reward_model."""
    return [*(rl.reward_funcs or []), *([MODEL_REWARD] if rl.reward_model else [])]


def reward_weights(rl: RLArgs) -> list[float]:
    """reward_weights, or 1.0 for each reward."""
    return [float(w) for w in rl.reward_weights] if rl.reward_weights is not None else [1.0] * len(reward_names(rl))


def check_rewards(cfg: RunConfig) -> None:
    """ConfigError (with the keys at fault) for reward keys that cannot work; nothing for a stage that scores no
    completions. Loads (so runs) the user's reward modules."""
    stage = STAGES.get(cfg.method.stage)
    if stage is None or not stage.samples:  # the stage row says whether it scores sampled completions
        return
    rl, source = resolved_rl(cfg), cfg.source

    def fail(message: str, key: str | tuple[str, ...]) -> None:
        raise ConfigError(f"{source}: {message}", key=key)

    if not rl.reward_funcs and not rl.reward_model:
        fail(f"stage {cfg.method.stage} needs a reward: set reward_funcs (built-ins {', '.join(BUILTINS)}, or "
             f"{FORMS}) and / or reward_model (a stage rm output, or a score server's URL)",
             ("reward_funcs", "reward_model"))
    _check_functions(rl, source)
    names = reward_names(rl)
    if rl.reward_weights is not None:
        if len(rl.reward_weights) != len(names):
            fail(f"reward_weights has {len(rl.reward_weights)} weights for {len(names)} rewards ({', '.join(names)}); "
                 f"give one per reward, in that order", "reward_weights")
        if not all(math.isfinite(float(w)) for w in rl.reward_weights):
            fail(f"reward_weights must be finite numbers (got {rl.reward_weights})", "reward_weights")
    _check_options(rl, source)
    _check_reward_model(cfg)


def _check_functions(rl: RLArgs, source: str) -> None:
    seen: set[str] = set()
    for entry in rl.reward_funcs or []:
        if entry in seen:
            raise ConfigError(f"{source}: reward_funcs lists '{entry}' twice; list it once (reward_weights sets "
                              f"how much it counts)", key="reward_funcs")
        seen.add(entry)
        if is_user_entry(entry):
            load_function(entry, source=source)
        elif entry not in BUILTINS:
            close = difflib.get_close_matches(entry, BUILTINS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{source}: reward_funcs entry '{entry}' is not a built-in reward; {hint}the built-ins: "
                              f"{', '.join(BUILTINS)}; a function of your own: {FORMS}", key="reward_funcs")


def _check_options(rl: RLArgs, source: str) -> None:
    funcs = rl.reward_funcs or []
    if "format" in funcs:
        if not rl.reward_format_pattern:
            raise ConfigError(f"{source}: the format reward needs reward_format_pattern, a regular expression the "
                              f"whole completion must match (e.g. '<think>.*</think>.*')", key="reward_format_pattern")
        try:
            re.compile(rl.reward_format_pattern, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"{source}: reward_format_pattern {rl.reward_format_pattern!r} is not a valid regular "
                              f"expression: {e}", key="reward_format_pattern") from None
    if "length" in funcs:
        if rl.max_completion_length < 1:
            raise ConfigError(f"{source}: max_completion_length must be >= 1 (got {rl.max_completion_length})",
                              key="max_completion_length")
        buffer = overlong_buffer(rl)
        if not 0 <= buffer <= rl.max_completion_length:
            raise ConfigError(f"{source}: overlong_buffer must be between 0 and max_completion_length "
                              f"({rl.max_completion_length}); got {buffer}", key="overlong_buffer")


def _check_reward_model(cfg: RunConfig) -> None:
    rl, source = resolved_rl(cfg), cfg.source
    if not rl.reward_model:
        if rl.reward_model_adapters:
            raise ConfigError(f"{source}: reward_model_adapters needs reward_model, the base model they were trained "
                              f"on", key=("reward_model_adapters", "reward_model"))
        return
    if rl.reward_model_type != "api":
        check_reward_model_files(cfg)
        return
    if not is_http_url(rl.reward_model):
        raise ConfigError(f"{source}: reward_model_type api needs reward_model to be the score server's http(s) URL "
                          f"(e.g. http://localhost:8000); got {rl.reward_model!r}", key=("reward_model", "reward_model_type"))
    for key in ("reward_model_adapters", "reward_model_quantization_bit"):
        if getattr(rl, key) is not None:
            raise ConfigError(f"{source}: {key} does not apply to a reward server (reward_model_type api); drop it",
                              key=key)


def required_columns(cfg: RunConfig, column_names: Sequence[str]) -> None:
    """DataError naming the column and the key when a reward needs a column the data lacks (accuracy's
    answers)."""
    stage = STAGES.get(cfg.method.stage)
    if stage is not None and stage.samples and "accuracy" in (cfg.rl.reward_funcs or []):
        answer_column(cfg.rl, column_names)
