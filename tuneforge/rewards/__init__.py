"""Rewards for the RL stages (grpo, ppo): score sampled completions.

    check_rewards(cfg)                       the reward keys' rules (config validation calls it; no torch)
    required_columns(cfg, column_names)      the columns the rewards read are in the data (DataError)
    build_rewards(cfg, tokenizer, device=)   -> Rewards: built-ins, the user's functions, a reward model / server
    rewards(prompts, completions, columns, completion_ids, texts=) -> RewardScores (per_reward, total)

The built-ins are in builtin.py, user functions in user.py, the reward model in model.py, the reward server in
server.py. This package imports torch only when Rewards, RewardScores or build_rewards is first used, so that
config validation stays light; it never imports tuneforge.train (train calls it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tuneforge.rewards.check import check_rewards, required_columns

if TYPE_CHECKING:
    from tuneforge.rewards.scoring import Rewards, RewardScores, build_rewards

__all__ = ["RewardScores", "Rewards", "build_rewards", "check_rewards", "required_columns"]
_SCORING = ("RewardScores", "Rewards", "build_rewards")


def __getattr__(name: str) -> Any:
    if name in _SCORING:
        return getattr(importlib.import_module("tuneforge.rewards.scoring"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
