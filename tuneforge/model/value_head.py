"""A scalar value head on a causal LM: the reward model of the rm stage, and the critic of the ppo stage.

ValueHeadModel wraps a causal LM (plain or peft) and a fp32 nn.Linear(hidden_size, 1). Scoring runs the
decoder only (no vocabulary projection) and reads the value head at each sequence's last real token
(`sequence_ends`, indices into input_ids.view(-1)). Attributes it does not define (config, get_decoder,
peft_config, active_adapter, gradient checkpointing methods, ...) are the wrapped model's, so the
trainer and checkpoint code treat it as the model; named_parameters() holds model.* and v_head.*.

Saved folders follow Hugging Face conventions plus one file: save_pretrained writes the wrapped model as
usual (an adapter folder for peft, a full model otherwise) and value_head.safetensors (v_head.weight,
v_head.bias). To score with a saved reward model, load the model (and adapter) from the folder as usual,
then `attach_value_head(model, folder)`. A PPO critic is saved as critic_head.safetensors instead: the ppo output
is a policy (chat, api, export and eval use it as any adapter or model), not a reward model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tuneforge.batch import Batch
from tuneforge.errors import ModelError
from tuneforge.trunk import trunk

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_HEAD_FILE = "critic_head.safetensors"
VALUE_HEAD_KEYS = ("v_head.weight", "v_head.bias")


def hidden_size(config: Any) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.hidden_size)


class ValueHeadModel(torch.nn.Module):
    """model: the causal LM (plain or peft-wrapped); v_head_state: saved v_head weights, else a fresh init: for a
    reward model zero-mean (normal, std 1/sqrt(hidden_size + 1); bias 0), for a critic (values regress on returns:
    the bias trains; saved as critic_head.safetensors) all zeros. A random critic's values differ by about the
    hidden states' RMS from one token to the next (~1.3 on SmolLM2-135M, against rewards of 0 or 1), and PPO's
    per-token advantages (differences of values) would be that noise until the critic learns; a zero critic
    starts them at the discounted reward itself.

    A reward model's bias is frozen. The rm loss reads only differences of scores (r_chosen − r_rejected), from which the
    bias cancels: its gradient is zero but for rounding (~1e-8), and AdamW normalizes a gradient that small into
    a step of up to the learning rate, so a trained bias (and every score with it) would drift by rounding
    noise, a different drift for another batch layout or number of processes. A head trained on absolute
    targets (a PPO critic's values) trains it."""

    def __init__(self, model: torch.nn.Module, v_head_state: Mapping[str, torch.Tensor] | None = None,
                 *, critic: bool = False) -> None:
        super().__init__()
        self.model = model
        self.head_file = CRITIC_HEAD_FILE if critic else VALUE_HEAD_FILE
        size = hidden_size(model.config)
        device = next(model.parameters()).device
        self.v_head = torch.nn.Linear(size, 1, dtype=torch.float32, device=device)
        if critic:
            torch.nn.init.zeros_(self.v_head.weight)
        else:
            torch.nn.init.normal_(self.v_head.weight, std=1 / math.sqrt(size + 1))
        torch.nn.init.zeros_(self.v_head.bias)
        self.v_head.bias.requires_grad_(critic)  # see the class docstring
        if v_head_state is not None:
            self.load_value_head_state(v_head_state)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters and submodules (model, v_head)
        except AttributeError:
            if name == "model":  # not set yet (inside __init__): do not recurse
                raise
            return getattr(self.model, name)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sequence_ends: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """fp32 values: (S,) at the given sequence_ends, else (batch, seq) at every position."""
        try:
            decoder = trunk(self.model)
        except (AttributeError, NotImplementedError, ValueError) as e:
            raise ModelError(
                f"{type(self.model).__name__} exposes no decoder (get_decoder: {e}); a value head needs "
                f"the decoder's hidden states"
            ) from None
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=False, **kwargs,
        ).last_hidden_state
        if sequence_ends is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1])[sequence_ends]
        with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
            return self.v_head(hidden.float()).squeeze(-1)

    def score(self, batch: Batch) -> torch.Tensor:
        """(S,) fp32 scores of a collated batch (padded or padding-free) that carries sequence_ends."""
        return self(**batch.model_inputs, sequence_ends=batch.targets["sequence_ends"])

    def value_head_state(self) -> dict[str, torch.Tensor]:
        return {
            "v_head.weight": self.v_head.weight.detach().contiguous().cpu(),
            "v_head.bias": self.v_head.bias.detach().contiguous().cpu(),
        }

    def load_value_head_state(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = [k for k in VALUE_HEAD_KEYS if k not in state]
        if missing:
            raise ModelError(f"the value head weights lack {', '.join(missing)}")
        with torch.no_grad():
            for key, param in (("v_head.weight", self.v_head.weight), ("v_head.bias", self.v_head.bias)):
                if tuple(state[key].shape) != tuple(param.shape):
                    raise ModelError(
                        f"{key} has shape {tuple(state[key].shape)}, but this model needs {tuple(param.shape)} "
                        f"(hidden_size {param.shape[-1]}); was the value head trained on another model?"
                    )
                param.copy_(state[key].to(param.device, torch.float32))

    def load_value_head_from(self, folder: str | Path) -> None:
        """The value head saved in folder (a checkpoint, or an rm / ppo output folder)."""
        self.load_value_head_state(load_value_head(folder, self.head_file))

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """The wrapped model's usual save_pretrained (adapter or full model) plus the head's file."""
        folder = Path(save_directory)
        self.model.save_pretrained(folder, **kwargs)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.value_head_state(), str(folder / self.head_file))


def load_value_head(folder: str | Path, name: str = VALUE_HEAD_FILE) -> dict[str, torch.Tensor]:
    """{v_head.weight, v_head.bias} from folder/value_head.safetensors (or the critic's file)."""
    path = Path(folder) / name
    if not path.is_file():
        what = "a stage ppo checkpoint" if name == CRITIC_HEAD_FILE else "a tuneforge reward model (stage rm) output folder"
        raise ModelError(f"{folder} has no {name}; it is not {what}")
    return load_file(str(path))


def attach_value_head(model: torch.nn.Module, folder: str | Path) -> ValueHeadModel:
    """A loaded model (and adapter) of a saved reward-model folder, with that folder's value head on it."""
    return ValueHeadModel(model, load_value_head(folder))


def score_token_rows(model: torch.nn.Module, rows: list[list[int]], pad_token_id: int | None,
                     device: torch.device) -> list[float]:
    """The value head's score of each token-id row, read at its last token (one forward: the caller batches).

    Right-padded, so each row's positions start at 0 and its last token is at len - 1."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id if pad_token_id is not None else 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    ends = torch.tensor([i * width + len(r) - 1 for i, r in enumerate(rows)])
    values = model(input_ids=ids.to(device), attention_mask=mask.to(device), sequence_ends=ends.to(device))
    return values.float().cpu().tolist()
