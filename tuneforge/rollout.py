"""What the RL objectives sample and score with, assembled by the workflow from infer (generation), data
(collation) and rewards, so that `train` imports none of them (train/objectives/grpo.py's `Rollouts`).

Generation is behind this one object: completions come from infer.generation.completion_generator today
(transformers' `generate`, with the stop tokens and sampling settings chat uses); a faster engine replaces
`__call__` without touching the stage. Everything is built on first use, so a stage that never samples renders
no template and loads no reward model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tuneforge.batch import Layout
    from tuneforge.config import RunConfig


class Rollouts:
    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self._generate: Any = None
        self._rewards: Any = None
        self._stops: frozenset[int] | None = None

    def __call__(self, model: Any, prompts: Sequence[Sequence[int]], **overrides: Any) -> list[list[int]]:
        return self._generator()(model, prompts, **overrides)

    def _generator(self) -> Any:
        if self._generate is None:
            from tuneforge.infer.generation import completion_generator

            self._generate = completion_generator(self.cfg, self.tokenizer)
        return self._generate

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a completion (eos and the chat template's end of turn)."""
        if self._stops is None:
            from tuneforge.infer.generation import chat_template, end_of_turn

            self._stops = frozenset(end_of_turn(self.tokenizer, chat_template(self.cfg, self.tokenizer)).token_ids)
        return self._stops

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def collate(self, groups: list[list[dict[str, list[int]]]], layout: Layout) -> tuple[dict, dict]:
        from tuneforge.data.collate import Collator

        return Collator(self.tokenizer.pad_token_id, layout).groups(groups)

    @property
    def reward_names(self) -> list[str]:
        """The rewards' names as logged (rewards/NAME/mean), in the order of score's per_reward columns, known once
        score has run: a built-in's name, a user function's own name (not its module or file path), reward_model."""
        names = list(self._rewards.names) if self._rewards is not None else []
        short = [name.rpartition(":")[2] for name in names]
        return short if len(set(short)) == len(short) else names

    def score(self, prompts: list[str], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rewards is None:
            from tuneforge.rewards import build_rewards

            self._rewards = build_rewards(self.cfg, self.tokenizer, device=device)
        scores = self._rewards(prompts, completions, columns, completion_ids)
        return scores.per_reward.to(device), scores.total.to(device)
