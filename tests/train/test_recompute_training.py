"""The training forward keeps the activations that are cheap to compute again as recipes (model/recompute.py),
except inside checkpointed layers, which keep only their inputs anyway."""

from __future__ import annotations

import pytest
import torch
from train_helpers import collate, make_cfg, random_dataset

from tuneforge.model import load_model, recompute
from tuneforge.train import Trainer


# per layer both norms' outputs and the MLP's product, in bf16 also both norms' fp32 copies of their input (the tiny
# model: 2 layers; padded rows: no attention recipe). In bf16 the final norm's fp32 copy too, checkpointed or not;
# without checkpointing the first norm keeps no copy: its input (the frozen embeddings' output) needs no gradient
@pytest.mark.parametrize("bf16, checkpointing_off, expected", [
    (False, True, 2 * 3), (True, True, 2 * 5 - 1 + 1), (False, False, 0), (True, False, 1)])
def test_the_training_forward_keeps_recipes_outside_checkpointed_layers(tmp_path, tiny_model_dir, monkeypatch,
                                                                        checkpointing_off, expected, bf16):
    cfg = make_cfg(tmp_path, tiny_model_dir, finetuning_type="lora", max_steps=1, per_device_train_batch_size=2,
                   disable_gradient_checkpointing=checkpointing_off, bf16=bf16)
    model = load_model(cfg)
    recipes = []
    pack = recompute._pack

    def counting(t):
        packed = pack(t)
        if not isinstance(packed, torch.Tensor) and not any(r is packed.recipe for r in recipes):
            recipes.append(packed.recipe)
        return packed

    monkeypatch.setattr(recompute, "_pack", counting)
    Trainer(cfg, model, None, random_dataset([6, 8], seed=3), None, collate).train()
    assert len(recipes) == expected
    assert not recompute._marked
