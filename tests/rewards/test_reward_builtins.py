"""The built-in rewards on crafted completions, against hand-computed values."""

from __future__ import annotations

import re

import pytest

from tuneforge.rewards.builtin import accuracy_reward, format_reward, length_reward, think_format_reward

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(("completion", "answer", "expected"), [
    ("The answer is 42.", "42", 1.0),
    ("So we get 42.0", "42", 1.0),
    ("In total 1,234 apples", "1234", 1.0),
    ("1234", "1,234", 1.0),
    ("The temperature drops to -3 degrees", "-3", 1.0),
    ("It is 3 degrees", "-3", 0.0),
    ("Three quarters: 3/4", "0.75", 1.0),
    ("The answer is 0.75", "3/4", 1.0),
    ("We get \\boxed{\\frac{3}{4}} since 4 - 1 = 3", "0.75", 1.0),  # the box wins over the last number
    ("First 5 and then \\boxed{12}. Check: 12 + 1 = 13", "12", 1.0),
    ("The total is 12 + 1 = 13", "12", 0.0),
    ("She sold 72 clips.\n#### 72", GSM8K_SOLUTION, 1.0),  # the answer column read GSM8K-style too
    ("She sold 71 clips.\n#### 71", GSM8K_SOLUTION, 0.0),
    ("<think>maybe 5, or 7</think>The answer is 6", "6", 1.0),  # reasoning is not the answer
    ("<think>it is 6</think>The answer is 5", "6", 0.0),
    ("  Paris.\n", "paris", 1.0),
    ("The capital is Paris.", "Paris", 0.0),  # exact match: a sentence around the answer is not the answer
    ("The answer is: **Paris**!", "Paris", 1.0),
    ("London", "Paris", 0.0),
    ("no number here", "42", 0.0),
    ("The answer is 42", 42, 1.0),  # a numeric column
    ("The answer is 42", ["41", "42"], 1.0),  # accepted answers
])
def test_accuracy(completion, answer, expected):
    assert accuracy_reward([completion], [answer]) == [expected]


@pytest.mark.parametrize("answer", [None, "", "  ", float("nan"), []])
def test_accuracy_has_no_opinion_without_an_answer(answer):
    assert accuracy_reward(["The answer is 42"], [answer]) == [None]


def test_format_matches_the_whole_stripped_completion_across_lines():
    pattern = re.compile(r"<think>.*</think>\s*<answer>.*</answer>", re.DOTALL)
    completions = [
        "  <think>a\nb</think>\n<answer>4</answer>\n",
        "<think>a</think><answer>4</answer> and more",
        "<answer>4</answer>",
    ]
    assert format_reward(completions, pattern) == [1.0, 0.0, 0.0]


def test_think_format():
    completions = [
        "<think>2 + 2</think>\n4",
        "<think>2 + 2</think>   ",  # no answer after the reasoning
        "4",
        "<think>a</think><think>b</think>4",
        "<think>unfinished 4",
    ]
    assert think_format_reward(["user: 2+2?\n"] * 5, completions) == [1.0, 0.0, 0.0, 0.0, 0.0]
    # a chat template that opens <think> in the generation prompt (DeepSeek-R1): the completion continues it
    assert think_format_reward(["<|Assistant|><think>\n"] * 2, ["2 + 2</think>4", "4"]) == [1.0, 0.0]


def test_length_is_dapo_soft_overlong_punishment():
    ids = [[0] * n for n in (0, 48, 52, 56, 64, 65, 200)]
    # L = 64, B = 16: free up to 48, then (48 - n) / 16, -1 past 64
    assert length_reward(ids, 64, 16) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert length_reward(ids, 64, 0) == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0]
