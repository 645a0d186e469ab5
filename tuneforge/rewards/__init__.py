"""Rewards for the RL stages (grpo, ppo): score sampled completions.

    check_rewards(cfg)                       the reward keys' rules (config validation calls it; no torch)
    required_columns(cfg, column_names)      the columns the rewards read are in the data (DataError)

The built-ins are in builtin.py, user functions in user.py, the reward model's folders in locate.py, the reward
server in server.py.
"""

from __future__ import annotations

from tuneforge.rewards.check import check_rewards, required_columns

__all__ = ["check_rewards", "required_columns"]
