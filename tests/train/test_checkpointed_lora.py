"""LoRA in bf16 through the trainer under each gradient checkpointing mode: the same losses.

The trainer lets plain LoRA layers skip peft's fp32 input copy under autocast (model/mixed_precision.py); a
checkpointed layer recomputes its forward during backward, so backward must run with the same setting, or
selective checkpointing finds different operations than it saved (it raises) — this is what the test guards."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import collate, make_cfg, random_dataset

from tuneforge.model import load_model
from tuneforge.train import Trainer


def _losses(tmp_path, tiny_model_dir, name: str, **keys) -> list[float]:
    cfg = make_cfg(tmp_path / name, tiny_model_dir, finetuning_type="lora", bf16=True, max_steps=3, logging_steps=1,
                   **keys)
    torch.manual_seed(0)
    model = load_model(cfg)
    Trainer(cfg, model, None, random_dataset([6, 7, 5, 8, 6, 7]), None, collate).train()
    lines = (tmp_path / name / "trainer_log.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


@pytest.mark.parametrize("mode, key", [("selective", None), ("full", False)])
def test_lora_bf16_trains_the_same_under_checkpointing(tmp_path, tiny_model_dir, selective_everywhere, mode, key):
    plain = _losses(tmp_path, tiny_model_dir, "none", disable_gradient_checkpointing=True)
    checkpointed = _losses(tmp_path, tiny_model_dir, mode, disable_gradient_checkpointing=key)
    assert len(plain) == 3
    assert checkpointed == pytest.approx(plain, rel=1e-3)
