"""Rewards for the RL stages (grpo, ppo): score sampled completions.

The built-ins are in builtin.py.
"""
