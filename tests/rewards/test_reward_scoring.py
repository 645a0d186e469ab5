"""Rewards: the weighted nansum, the user's functions called TRL-style, and errors that name the function."""

from __future__ import annotations

import math

import pytest
import torch

from tuneforge.errors import TrainingError
from tuneforge.rewards import Rewards, RewardScores, build_rewards

PROMPTS = ["user: 6 x 7?\nassistant: ", "user: 6 x 7?\nassistant: ", "user: capital of France?\nassistant: "]
COMPLETIONS = ["The answer is 42.", "<think>6 x 7</think>41", "Paris"]
COLUMNS = [{"answer": "42", "level": 1}, {"answer": "42", "level": 1}, {"answer": "Paris", "level": 2}]
IDS = [[1] * 50, [1] * 56, [1] * 70]


def score(rewards: Rewards, **overrides) -> RewardScores:
    args = dict(prompts=PROMPTS, completions=COMPLETIONS, columns=COLUMNS, completion_ids=IDS) | overrides
    return rewards(**args)


def test_total_is_the_weighted_sum_with_none_counted_as_zero():
    rewards = Rewards(["a", "b"], [2.0, 0.5], [lambda x: [1.0, None, 0.0], lambda x: [None, 4.0, 2.0]])
    scores = score(rewards)
    expected = torch.tensor([[1.0, math.nan], [math.nan, 4.0], [0.0, 2.0]])
    torch.testing.assert_close(scores.per_reward, expected, equal_nan=True)
    torch.testing.assert_close(scores.total, torch.tensor([2.0, 2.0, 1.0]))  # 2*1; 0.5*4; 2*0 + 0.5*2
    assert scores.per_reward.dtype == scores.total.dtype == torch.float32


def test_builtins_from_the_config(rl_cfg):
    cfg = rl_cfg(reward_funcs=["accuracy", "think_format", "length"], reward_weights=[1.0, 0.5, 1.0],
                 max_completion_length=64, overlong_buffer=16)
    rewards = build_rewards(cfg, None, device="cpu")
    assert rewards.names == ["accuracy", "think_format", "length"] and rewards.weights == [1.0, 0.5, 1.0]
    scores = score(rewards)
    # accuracy 1, 0, 1; think_format 0, 1, 0; length (50, 56, 70 tokens; free up to 48): -2/16, -8/16, -1
    expected = torch.tensor([[1.0, 0.0, -0.125], [0.0, 1.0, -0.5], [1.0, 0.0, -1.0]])
    torch.testing.assert_close(scores.per_reward, expected)
    torch.testing.assert_close(scores.total, torch.tensor([0.875, 0.0, 0.0]))


USER_FILE = '''
def exact(completions, answer, **kwargs):
    assert sorted(kwargs) == ["completion_ids", "level", "prompts"], sorted(kwargs)
    return [1.0 if c.strip(".").endswith(a) else 0.0 for c, a in zip(completions, answer)]

def shorter_than(completions, completion_ids, limit=55):  # no **kwargs: gets only what it names
    return [None if len(c) > 20 else float(len(ids) < limit) for c, ids in zip(completions, completion_ids)]

def by_level(level, **kwargs):
    return [float(x) for x in level]
'''


def test_user_functions_from_a_file_get_the_columns(rl_cfg, tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    names = [f"{path}:exact", f"{path}:shorter_than", f"{path}:by_level"]
    rewards = build_rewards(rl_cfg(reward_funcs=names), None, device="cpu")
    assert rewards.names == names and rewards.weights == [1.0, 1.0, 1.0]
    scores = score(rewards)
    expected = torch.tensor([[1.0, 1.0, 1.0], [0.0, math.nan, 1.0], [1.0, 0.0, 2.0]])
    torch.testing.assert_close(scores.per_reward, expected, equal_nan=True)
    torch.testing.assert_close(scores.total, torch.tensor([3.0, 1.0, 3.0]))


def user_rewards(tmp_path, body: str) -> Rewards:
    path = tmp_path / "bad_rewards.py"
    path.write_text(body)
    return Rewards([f"{path}:bad"], [1.0], [_user(f"{path}:bad")])


def _user(entry):
    from tuneforge.rewards.user import UserReward, load_function

    return UserReward(entry, load_function(entry, source="rl.yaml"))


def test_a_function_that_raises_is_named_and_chained(tmp_path):
    rewards = user_rewards(tmp_path, "def bad(completions, **kw):\n    raise KeyError('answer')\n")
    with pytest.raises(TrainingError, match=r"reward function .*bad_rewards.py:bad \(reward_funcs\) failed.*KeyError") as info:
        score(rewards)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(("returns", "message"), [
    ("[1.0, 2.0]", r"returned 2 values for 3 completions"),
    ("7.0", r"returned a float; it must return a list"),
    ("[1.0, float('inf'), 0.0]", r"gave completion 1 the value inf, not a finite number.*'user: 6 x 7\?\\nassistant: '"),
    ("[1.0, 'yes', 0.0]", r"gave completion 1 the value 'yes'"),
])
def test_a_bad_return_names_the_function_and_the_completion(tmp_path, returns, message):
    rewards = user_rewards(tmp_path, f"def bad(completions, **kw):\n    return {returns}\n")
    with pytest.raises(TrainingError, match=r"reward .*bad_rewards.py:bad " + message):
        score(rewards)


def test_a_completion_no_reward_scores_is_refused():
    rewards = Rewards(["a", "b"], [1.0, 1.0], [lambda x: [1.0, None, 1.0], lambda x: [0.0, None, None]])
    with pytest.raises(TrainingError, match=r"no reward scored completion 1 \(every one of a, b returned None"):
        score(rewards)


def test_a_parameter_that_is_no_column_is_named(tmp_path):
    rewards = user_rewards(tmp_path, "def bad(completions, solution):\n    return [0.0] * len(completions)\n")
    with pytest.raises(TrainingError, match=r"takes solution, which is neither .* \(the columns: answer, level\)"):
        score(rewards)


def test_texts_default_to_prompt_plus_completion():
    seen = []
    rewards = Rewards(["t"], [1.0], [lambda x: seen.append(x.texts) or [0.0] * len(x.texts)])
    score(rewards)
    score(rewards, texts=["a", "b", "c"])
    assert seen == [[p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)], ["a", "b", "c"]]
