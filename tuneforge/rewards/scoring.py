"""Rewards: every reward of a config scoring one batch of completions, and their weighted total."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.config.rl import resolved_rl
from tuneforge.errors import ConfigError, TrainingError
from tuneforge.rewards.builtin import BUILTINS
from tuneforge.rewards.check import check_rewards, reward_names, reward_weights
from tuneforge.rewards.inputs import RewardInputs
from tuneforge.rewards.server import RewardServer, api_key_from_environment
from tuneforge.rewards.user import UserReward, is_user_entry, load_function

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

ScoreFunction = Callable[[RewardInputs], Sequence[Any]]


@dataclass
class RewardScores:
    """per_reward: (n, k) float32, NaN where a reward returned None; total: (n,) float32, the weighted sum over
    the rewards with NaN counted as 0."""

    per_reward: torch.Tensor
    total: torch.Tensor


class Rewards:
    """names[j] / weights[j] / functions[j]: reward j. Calling it scores n completions (see __call__)."""

    def __init__(self, names: list[str], weights: list[float], functions: list[ScoreFunction]) -> None:
        if not len(names) == len(weights) == len(functions):
            raise ValueError(f"{len(names)} names, {len(weights)} weights and {len(functions)} functions")
        self.names, self.weights, self.functions = names, weights, functions

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        columns: list[dict[str, Any]],
        completion_ids: list[list[int]],
        *,
        texts: list[str] | None = None,
    ) -> RewardScores:
        """prompts[i]: completion i's rendered prompt (generation prompt included); completions[i]: its decoded
        text; columns[i]: its dataset row's other columns; completion_ids[i]: its token ids; texts[i]: what the
        reward model reads (default prompts[i] + completions[i]). Scores stay on the CPU."""
        n = len(completions)
        if not len(prompts) == len(columns) == len(completion_ids) == n or (texts is not None and len(texts) != n):
            raise ValueError(f"{n} completions but {len(prompts)} prompts, {len(columns)} rows of columns, "
                             f"{len(completion_ids)} completion_ids and {'no' if texts is None else len(texts)} texts")
        if texts is None:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = RewardInputs(prompts, completions, columns, completion_ids, texts)
        per_reward = torch.full((n, len(self.names)), math.nan, dtype=torch.float32)
        for j, (name, function) in enumerate(zip(self.names, self.functions, strict=True)):
            per_reward[:, j] = torch.tensor(checked_scores(name, function(inputs), prompts), dtype=torch.float32)
        unscored = per_reward.isnan().all(dim=1).nonzero().flatten().tolist() if self.names else []
        if unscored:
            i = unscored[0]
            raise TrainingError(f"no reward scored completion {i} (every one of {', '.join(self.names)} returned "
                                f"None; prompt {_head(prompts[i])}): add a reward that scores every completion, or "
                                f"give this row what its rewards need (e.g. an answer)")
        weights = torch.tensor(self.weights, dtype=torch.float32)
        return RewardScores(per_reward, (per_reward * weights).nansum(dim=1))


def checked_scores(name: str, values: Any, prompts: Sequence[str]) -> list[float]:
    """values as n floats (None -> NaN); TrainingError naming the reward for anything else."""
    n = len(prompts)
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a tensor or an array
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TrainingError(f"reward {name} returned a {type(values).__name__}; it must return a list with one float "
                            f"(or None) per completion")
    if len(values) != n:
        raise TrainingError(f"reward {name} returned {len(values)} values for {n} completions; it must return one "
                            f"float (or None) per completion")
    scores = []
    for i, value in enumerate(values):
        if value is None:
            scores.append(math.nan)
            continue
        if hasattr(value, "item") and not isinstance(value, numbers.Real):  # a one-element tensor or array
            try:
                value = value.item()
            except (ValueError, RuntimeError):
                pass  # several elements: refused below
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise TrainingError(f"reward {name} gave completion {i} the value {value!r}, not a finite number or None "
                                f"(its prompt: {_head(prompts[i])})")
        scores.append(float(value))
    return scores


def _head(text: str) -> str:
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


def build_rewards(cfg: RunConfig, tokenizer: Any, *, device: torch.device | str) -> Rewards:
    """The rewards of cfg: reward_funcs in order, then the reward model (loaded on device, frozen) or server.
    tokenizer: the policy's (the reward model reads texts with its own)."""
    check_rewards(cfg)
    rl = resolved_rl(cfg)
    names = reward_names(rl)
    if not names:
        raise ConfigError(f"{cfg.source}: no reward to score completions with: set reward_funcs and / or "
                          f"reward_model", key=("reward_funcs", "reward_model"))
    functions: list[ScoreFunction] = []
    for entry in rl.reward_funcs or []:
        if is_user_entry(entry):
            functions.append(UserReward(entry, load_function(entry, source=cfg.source)))
        else:
            functions.append(BUILTINS[entry].bind(rl))
    if rl.reward_model:
        functions.append(_reward_model(cfg, tokenizer, device))
    return Rewards(names, reward_weights(rl), functions)


def _reward_model(cfg: RunConfig, tokenizer: Any, device: torch.device | str) -> ScoreFunction:
    if cfg.rl.reward_model_type == "api":
        return RewardServer(cfg.rl.reward_model, api_key=api_key_from_environment())
    from tuneforge.rewards.model import RewardModel

    return RewardModel.load(cfg, tokenizer, device=device)
