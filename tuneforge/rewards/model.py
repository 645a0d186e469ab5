"""A reward model (reward_model_type lora / full): a stage rm output scoring texts with its value head.

It loads as `tuneforge chat` / `api` load an rm output (model.inference.load_inference_model: adapters
merged, eval mode, value head attached), frozen, on the training process's device. Each text is tokenized
with the reward model's own tokenizer, without special tokens (the text is already rendered), cut on the
left to the model's context so its end survives, and scored at its last token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from tuneforge.errors import TrainingError
from tuneforge.model.value_head import score_token_rows
from tuneforge.rewards.inputs import RewardInputs
from tuneforge.rewards.locate import reward_model_location

if TYPE_CHECKING:
    from tuneforge.config import RunConfig

logger = logging.getLogger(__name__)

SCORE_BATCH = 16  # texts per forward pass


def context_length(config: Any) -> int | None:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
    return int(n) if n else None


class RewardModel:
    """score(texts) -> one float per text: the value head at the text's last token."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_length: int | None = None,
                 batch_size: int = SCORE_BATCH) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = max_length or context_length(model.config)
        self.device = next(model.parameters()).device

    @classmethod
    def load(cls, cfg: RunConfig, policy_tokenizer: Any, *, device: torch.device | str) -> RewardModel:
        from tuneforge.model.inference import load_inference_model
        from tuneforge.model.load import load_tokenizer

        rl = cfg.rl
        where = reward_model_location(rl, source=cfg.source)
        model_args = replace(cfg.model, model_name_or_path=where.base, adapter_name_or_path=list(where.adapters) or None,
                             quantization_bit=rl.reward_model_quantization_bit)
        model = load_inference_model(replace(cfg, model=model_args), device=device, value_head=True)
        model.requires_grad_(False)
        tokenizer = load_tokenizer(model_args)
        theirs, ours = getattr(tokenizer, "chat_template", None), getattr(policy_tokenizer, "chat_template", None)
        if theirs and ours and theirs != ours:
            logger.warning("the reward model's chat template differs from the policy's: it scores texts rendered "
                           "with the policy's template, not the one it was trained on")
        return cls(model, tokenizer)

    def __call__(self, inputs: RewardInputs) -> list[float]:
        return self.score(inputs.texts)

    @torch.no_grad()  # not inference_mode: scores may meet autograd later (advantages times log-probs)
    def score(self, texts: Sequence[str]) -> list[float]:
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        empty = next((i for i, r in enumerate(rows) if not r), None)
        if empty is not None:
            raise TrainingError(f"the reward model cannot score text {empty}: it is empty")
        if self.max_length:
            rows = [r[-self.max_length :] for r in rows]  # keep the end: the completion being scored
        scores: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            scores += score_token_rows(self.model, batch, self.tokenizer.pad_token_id, self.device)
        return scores

