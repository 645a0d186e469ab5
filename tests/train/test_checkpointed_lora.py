"""LoRA in bf16 through the trainer under each gradient checkpointing mode: the same losses.

The trainer lets plain LoRA layers skip peft's fp32 input copy under autocast (model/mixed_precision.py); a
checkpointed layer recomputes its forward during backward, so backward must run with the same setting, or
selective checkpointing finds different operations than it saved (it raises) — this is what the test guards."""

from __future__ import annotations

import json
import logging

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


def test_each_micro_batch_checkpoints_as_its_tokens_need_and_trains_the_same(tmp_path, tiny_model_dir, monkeypatch,
                                                                             caplog):
    """Unset, the memory plan is chosen again for each micro-batch; a large recompute share lets the activation cap
    bite on the tiny model's 2 layers: the long micro-batches run with their first layer checkpointed."""
    from tuneforge.model import checkpointing

    monkeypatch.setattr(checkpointing, "available_bytes", lambda device: 1e12)
    monkeypatch.setattr(checkpointing, "RECOMPUTE_SHARE", 0.5)
    rows = random_dataset([5, 6, 40, 5, 6, 5, 38, 6], seed=1)  # padded: 10-12 tokens a batch, 76-80 with a long row

    def run(name: str, **keys) -> tuple[list[float], dict, list[int]]:
        cfg = make_cfg(tmp_path / name, tiny_model_dir, finetuning_type="lora", max_steps=4, logging_steps=1,
                       per_device_train_batch_size=2, **keys)
        torch.manual_seed(0)
        model = load_model(cfg)
        layer = model.get_base_model().model.layers[0]
        calls = []  # tokens of each run of the first layer's q_proj: twice a micro-batch where it is checkpointed
        layer.self_attn.q_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[:-1].numel()))
        with caplog.at_level(logging.INFO, logger="tuneforge"):
            Trainer(cfg, model, None, rows, None, collate).train()
        lines = [json.loads(line) for line in (tmp_path / name / "trainer_log.jsonl").read_text().splitlines()]
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return [line["loss"] for line in lines if "loss" in line], lora, calls

    plain, plain_lora, plain_calls = run("none", disable_gradient_checkpointing=True)
    chosen, chosen_lora, chosen_calls = run("chosen", disable_gradient_checkpointing=None)
    long_batches = [tokens for tokens in plain_calls if tokens > 24]
    assert long_batches and len(long_batches) < len(plain_calls)
    # each long micro-batch's first layer runs again in backward; the short ones run once
    assert sorted(chosen_calls) == sorted(plain_calls + long_batches)
    assert "a micro-batch of more than 12 tokens checkpoints" in caplog.text
    assert chosen == plain and len(plain) == 4
    for name, weight in plain_lora.items():
        assert torch.equal(chosen_lora[name], weight), name


def test_the_cap_counts_tokens_without_reading_media(tmp_path, tiny_model_dir):
    """The sample that chooses the cap is collated without any media column (a feedback row's kl_ one too):
    only token counts matter, and decoding images there would cost time for nothing."""
    rows = random_dataset([5, 6, 7, 8]).add_column("mm_inputs", [b""] * 4).add_column("kl_mm_inputs", [b"x"] * 4)
    seen = []

    def collator(batch_rows):
        seen.append(sorted(key for key in batch_rows[0] if key.endswith("mm_inputs")))
        return collate(batch_rows)

    cfg = make_cfg(tmp_path, tiny_model_dir, finetuning_type="lora", max_steps=1, per_device_train_batch_size=2,
                   disable_gradient_checkpointing=None)
    Trainer(cfg, load_model(cfg), None, rows, None, collator).train()
    assert seen == [[], [], ["kl_mm_inputs", "mm_inputs"]]  # the 2 sampled micro-batches, then the step's
