"""New tokens and checkpoints: a run resumed from a checkpoint ends where an uninterrupted one does (the new rows
start from the seed, the trained embedding is in the checkpoint)."""

from __future__ import annotations

import shutil

import torch
from safetensors import safe_open
from train_helpers import collate, make_cfg, random_dataset

from tuneforge.model import load_model
from tuneforge.train import Trainer

LENGTHS = [5, 8, 6, 9, 4, 7, 10, 6]


def train(out, model_dir, seed: int = 0, **keys):
    cfg = make_cfg(out, model_dir, finetuning_type="lora", lora_target="q_proj", add_special_tokens="<a>,<b>",
                   max_steps=4, save_strategy="steps", save_steps=2, learning_rate=1e-2,
                   disable_gradient_checkpointing=True, **keys)
    torch.manual_seed(seed)  # the global generator: not what the new rows are drawn from
    model = load_model(cfg)
    rows = random_dataset(LENGTHS, low=49000, high=49154)  # the new ids 49152, 49153 among them
    Trainer(cfg, model, None, rows, None, collate).train()
    return model


def test_a_resumed_run_with_new_tokens_matches_an_uninterrupted_one(tmp_path, tiny_model_dir):
    full = train(tmp_path / "a", tiny_model_dir)
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    with safe_open(tmp_path / "a" / "checkpoint-2" / "adapter_model.safetensors", "pt") as f:
        assert {k for k in f.keys() if "lora_" not in k} <= {"base_model.model.model.embed_tokens.weight",
                                                              "base_model.model.lm_head.weight"}
    resumed = train(tmp_path / "b", tiny_model_dir, seed=123, resume_from_checkpoint=True)
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)
