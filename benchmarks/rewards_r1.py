"""Workload R1's reward (benchmarks/rl_throughput.py): answers of about twenty words score best.

The same rule as the TRL peer's (../shared/bench/peer-trl-grpo.py): -|words - 20| / 20, words split on
whitespace. Called as any user reward is, `reward_funcs: [benchmarks/rewards_r1.py:twenty_words]`.
"""

from __future__ import annotations

from typing import Any

TARGET_WORDS = 20


def completion_text(completion: Any) -> str:
    """A completion as plain text, or as a conversation whose last message is the answer."""
    if isinstance(completion, list):
        return completion[-1]["content"]
    return completion


def twenty_words(completions: list[Any], **_: Any) -> list[float]:
    return [-abs(len(completion_text(c).split()) - TARGET_WORDS) / TARGET_WORDS for c in completions]
