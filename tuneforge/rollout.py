"""What the RL objectives sample and score with, assembled by the workflow from infer (generation), data
(collation) and rewards, so that `train` imports none of them (train/objectives/grpo.py's `Rollouts`).

Generation is behind this one object: completions come from infer.generation.completion_generator today
(transformers' `generate`, with the stop tokens and sampling settings chat uses), on a CPU in fp32 with the linear
layers packed for the call (model/packed_linear.py); a faster engine replaces `__call__` without touching the
stage. Everything is built on first use, so a stage that never samples renders no template and loads no reward
model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tuneforge.batch import Layout
    from tuneforge.config import RunConfig


class Rollouts:
    def __init__(self, cfg: RunConfig, tokenizer: Any, processor: Any = None) -> None:
        """processor: a vision- / audio-language model's (its chat template and end of turn; its media tokens)."""
        self.cfg, self.tokenizer, self.processor = cfg, tokenizer, processor
        self._generate: Any = None
        self._rewards: Any = None
        self._stops: frozenset[int] | None = None
        self._media_ids = frozenset(media_token_ids(processor)) if processor is not None else frozenset()

    def __call__(self, model: Any, prompts: Sequence[Sequence[int]], **overrides: Any) -> list[list[int]]:
        from tuneforge.model.packed_linear import packed_while_generating

        with packed_while_generating(model):  # fp32 on a CPU: packed copies of the current weights, LoRA merged
            return self._generator()(model, prompts, **overrides)

    def _generator(self) -> Any:
        if self._generate is None:
            from tuneforge.infer.generation import completion_generator

            self._generate = completion_generator(self.cfg, self.tokenizer, self.processor)
        return self._generate

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a completion (eos and the chat template's end of turn)."""
        if self._stops is None:
            from tuneforge.infer.generation import chat_template, end_of_turn

            template = chat_template(self.cfg, self.processor or self.tokenizer)
            self._stops = frozenset(end_of_turn(self.tokenizer, template, self.processor).token_ids)
        return self._stops

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ids; a run of one media token (an image's 64 <|image_pad|>) reads as one, so the rewards
        see where each medium was without its expansion."""
        ids = list(ids)
        if self._media_ids:
            ids = [t for i, t in enumerate(ids) if not (t in self._media_ids and i and ids[i - 1] == t)]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def collate(self, groups: list[list[dict[str, list[int]]]], layout: Layout,
                media: Sequence[bytes | None] | None = None) -> tuple[dict, dict]:
        from tuneforge.data.collate import Collator
        from tuneforge.data.multimodal import MEDIA_COLUMN

        if media:  # per-token media inputs are padded with 0 (text) over the completion
            groups = [[{**s, MEDIA_COLUMN: blob} for s in group] for group, blob in zip(groups, media, strict=True)]
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


def media_token_ids(processor: Any) -> list[int]:
    """The ids of the tokens the processor expands for each medium (<|image_pad|>, <image>, ...)."""
    from tuneforge.data.media import KINDS, media_token

    tokens = [media_token(processor, kind) for kind in KINDS]
    return [processor.tokenizer.convert_tokens_to_ids(t) for t in tokens if t]
