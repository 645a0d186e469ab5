"""The built-in rewards: accuracy, format, think_format, length.

Each is a pure function of the completions (and what it needs besides) returning one float, or None for
"no opinion", per completion. BUILTINS binds each to its config keys, giving a function of RewardInputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tuneforge.errors import DataError
from tuneforge.rewards.answers import is_correct, is_missing
from tuneforge.rewards.inputs import RewardInputs

if TYPE_CHECKING:
    from tuneforge.config.schema import RLArgs

ANSWER_COLUMNS = ("answer", "solution", "ground_truth")
RewardFunction = Callable[[RewardInputs], Sequence[Any]]


def accuracy_reward(completions: Sequence[str], answers: Sequence[Any]) -> list[float | None]:
    """1.0 when a completion's final answer equals its row's answer, else 0.0; None where the row has none."""
    return [None if is_missing(a) else float(is_correct(c, a)) for c, a in zip(completions, answers, strict=True)]


def format_reward(completions: Sequence[str], pattern: re.Pattern[str]) -> list[float]:
    """1.0 when the whole completion (stripped) matches pattern, else 0.0."""
    return [float(pattern.fullmatch(c.strip()) is not None) for c in completions]


def think_format_reward(prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """1.0 when a completion is one <think>...</think> block followed by a non-empty answer, else 0.0."""
    return [float(_thinks_then_answers(p, c)) for p, c in zip(prompts, completions, strict=True)]


def _thinks_then_answers(prompt: str, completion: str) -> bool:
    text = completion.strip()
    if prompt.rstrip().endswith("<think>") and not text.startswith("<think>"):
        text = "<think>" + text  # the chat template opened the reasoning in the prompt (DeepSeek-R1, Qwen3)
    if not text.startswith("<think>") or text.count("<think>") != 1 or text.count("</think>") != 1:
        return False
    return bool(text.split("</think>", 1)[1].strip())


def length_reward(completion_ids: Sequence[Sequence[int]], max_length: int, buffer: int) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then falling linearly to -1 at
    max_length, and -1 beyond it."""
    free = max_length - buffer
    scores = []
    for ids in completion_ids:
        n = len(ids)
        if n <= free:
            scores.append(0.0)
        elif n <= max_length:
            scores.append((free - n) / buffer)
        else:
            scores.append(-1.0)
    return scores


def overlong_buffer(rl: RLArgs) -> int:
    """The length reward's buffer: overlong_buffer, else a quarter of max_completion_length."""
    return rl.overlong_buffer if rl.overlong_buffer is not None else rl.max_completion_length // 4


def answer_column(rl: RLArgs, column_names: Sequence[str]) -> str:
    """The column holding each row's right answer: reward_answer_column, else the first of answer, solution,
    ground_truth the data has. DataError naming the columns it has when there is none."""
    names = list(column_names)
    if rl.reward_answer_column is not None:
        if rl.reward_answer_column not in names:
            raise DataError(f"the accuracy reward reads the right answers from column '{rl.reward_answer_column}' "
                            f"(reward_answer_column), but the dataset has no such column; its columns: "
                            f"{', '.join(names) or 'none'}. Set reward_answer_column to one of them")
        return rl.reward_answer_column
    for name in ANSWER_COLUMNS:
        if name in names:
            return name
    raise DataError(f"the accuracy reward needs each row's right answer, but the dataset has none of the columns "
                    f"{', '.join(ANSWER_COLUMNS)}; its columns: {', '.join(names) or 'none'}. Set "
                    f"reward_answer_column to the column that holds the answer")


@dataclass(frozen=True)
class Builtin:
    """A built-in reward: bind(rl) gives its function of RewardInputs, with its options read from rl."""

    name: str
    summary: str
    bind: Callable[[RLArgs], RewardFunction]


def _accuracy(rl: RLArgs) -> RewardFunction:
    return lambda x: accuracy_reward(x.completions, x.column(answer_column(rl, x.column_names())))


def _format(rl: RLArgs) -> RewardFunction:
    pattern = re.compile(rl.reward_format_pattern or "", re.DOTALL)
    return lambda x: format_reward(x.completions, pattern)


def _think_format(_rl: RLArgs) -> RewardFunction:
    return lambda x: think_format_reward(x.prompts, x.completions)


def _length(rl: RLArgs) -> RewardFunction:
    max_length, buffer = rl.max_completion_length, overlong_buffer(rl)
    return lambda x: length_reward(x.completion_ids, max_length, buffer)


BUILTINS: dict[str, Builtin] = {b.name: b for b in (
    Builtin("accuracy", "1 when the final answer equals the row's answer column, else 0", _accuracy),
    Builtin("format", "1 when the whole completion matches reward_format_pattern, else 0", _format),
    Builtin("think_format", "1 for <think>...</think> then a non-empty answer, else 0", _think_format),
    Builtin("length", "0, falling to -1 over the last overlong_buffer tokens of max_completion_length", _length),
)}
