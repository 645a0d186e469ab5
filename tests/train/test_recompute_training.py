"""The training forward keeps the activations that are cheap to compute again as recipes (model/recompute.py),
except inside checkpointed layers, which keep only their inputs anyway."""

from __future__ import annotations

import pytest
import torch
from train_helpers import collate, make_cfg, random_dataset

from tuneforge.model import load_model, recompute
from tuneforge.train import Trainer


@pytest.mark.parametrize("checkpointing_off, recipes_per_layer", [(True, 3), (False, 0)])
def test_the_training_forward_keeps_recipes_outside_checkpointed_layers(tmp_path, tiny_model_dir, monkeypatch,
                                                                        checkpointing_off, recipes_per_layer):
    cfg = make_cfg(tmp_path, tiny_model_dir, finetuning_type="lora", max_steps=1, per_device_train_batch_size=2,
                   disable_gradient_checkpointing=checkpointing_off)
    model = load_model(cfg)
    recipes = set()
    pack = recompute._pack

    def counting(t):
        packed = pack(t)
        if not isinstance(packed, torch.Tensor):
            recipes.add(id(packed.recipe))
        return packed

    monkeypatch.setattr(recompute, "_pack", counting)
    Trainer(cfg, model, None, random_dataset([6, 8], seed=3), None, collate).train()
    # both norms' outputs and the MLP's product, in each of the tiny model's 2 layers (padded: no attention recipe)
    assert len(recipes) == 2 * recipes_per_layer
    assert not recompute._marked
