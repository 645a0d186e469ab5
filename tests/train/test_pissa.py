"""PiSSA runs: the saved adapter works on the original base model, and a resumed run is the same run."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from train_helpers import collate, make_cfg, random_dataset, trainable_state
from transformers import AutoModelForCausalLM

from tuneforge.errors import TrainingError
from tuneforge.model import load_model
from tuneforge.train import Trainer

LENGTHS = [5, 8, 6, 9, 4, 7, 10, 6, 5, 8]
BATCH = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(5))


def pissa_cfg(out, model_dir, **keys):
    base = dict(finetuning_type="lora", lora_rank=4, pissa_init=True, pissa_iter=2, learning_rate=1e-2,
                max_steps=3, disable_gradient_checkpointing=True)
    return make_cfg(out, model_dir, **{**base, **keys})


@torch.no_grad()
def logits(model) -> torch.Tensor:
    model.eval()
    return model(input_ids=BATCH).logits


def on_original_base(model_dir, adapter_dir):
    """What a user does with our output: plain transformers + peft, on the model they started from."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir)


def train(cfg, seed: int = 0):
    torch.manual_seed(seed)  # seeds the randomized SVD of a fresh PiSSA init
    model = load_model(cfg)
    Trainer(cfg, model, None, random_dataset(LENGTHS), None, collate).train()
    return model


@pytest.mark.parametrize("keys", [{}, {"additional_target": "embed_tokens"}], ids=["lora", "modules-to-save"])
def test_converted_adapter_on_the_original_base_gives_the_trained_outputs(tmp_path, tiny_model_dir, keys):
    out = tmp_path / "out"
    model = train(pissa_cfg(out, tiny_model_dir, **keys))
    trained = logits(model)
    loaded = on_original_base(tiny_model_dir, out)
    assert loaded.peft_config["default"].r == 8 and loaded.peft_config["default"].init_lora_weights is True
    assert (logits(loaded) - trained).abs().max() < 1e-4
    assert (logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) - trained).abs().max() > 1e-3
    initial = load_file(out / "pissa_init" / "adapter_model.safetensors")
    assert initial.keys() <= load_file(out / "adapter_model.safetensors").keys()


def test_without_conversion_the_adapter_is_saved_as_trained_with_a_warning(tmp_path, tiny_model_dir, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="tuneforge"):
        model = train(pissa_cfg(out, tiny_model_dir, pissa_convert=False))
    assert "applies to PiSSA's residual base" in caplog.text
    saved = load_file(out / "adapter_model.safetensors")
    assert saved.keys() == {k.replace(".default", "") for k in trainable_state(model)}
    for key, value in trainable_state(model).items():
        assert torch.equal(saved[key.replace(".default", "")], value)
    # on the original base it is wrong: the principal part counts twice
    assert (logits(on_original_base(tiny_model_dir, out)) - logits(model)).abs().max() > 1e-3


def test_resumed_pissa_run_matches_an_uninterrupted_one(tmp_path, tiny_model_dir):
    keys = dict(max_steps=5, save_strategy="steps", save_steps=2)
    full = train(pissa_cfg(tmp_path / "a", tiny_model_dir, **keys))
    # a run killed after step 2 left its checkpoint and initial adapter; a new process draws other SVD numbers
    for name in ("checkpoint-2", "pissa_init"):
        shutil.copytree(tmp_path / "a" / name, tmp_path / "b" / name)
    resumed = train(pissa_cfg(tmp_path / "b", tiny_model_dir, resume_from_checkpoint=True, **keys), seed=123)
    for name, value in full.state_dict().items():  # adapter and residual base alike
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(logits(on_original_base(tiny_model_dir, tmp_path / "b")), logits(full),
                               rtol=0, atol=1e-4)
    # what the resume had to undo: a fresh init with that seed trains on another residual base
    torch.manual_seed(123)
    fresh = load_model(pissa_cfg(tmp_path / "c", tiny_model_dir))
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert (fresh.state_dict()[q_proj] - full.state_dict()[q_proj]).abs().max() > 1e-3


def test_resume_without_the_initial_adapter_is_refused(tmp_path, tiny_model_dir):
    keys = dict(max_steps=2, save_strategy="steps", save_steps=2)
    train(pissa_cfg(tmp_path / "a", tiny_model_dir, **keys))
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    cfg = pissa_cfg(tmp_path / "b", tiny_model_dir, resume_from_checkpoint=True, **{**keys, "max_steps": 4})
    with pytest.raises(TrainingError, match=r"checkpoint-2: it is a PiSSA run, which needs .*b/pissa_init"):
        train(cfg)


def test_resume_of_a_model_not_rebuilt_from_the_initial_adapter_is_refused(tmp_path, tiny_model_dir):
    keys = dict(max_steps=2, save_strategy="steps", save_steps=2)
    train(pissa_cfg(tmp_path / "a", tiny_model_dir, **keys))
    cfg = pissa_cfg(tmp_path / "a", tiny_model_dir, resume_from_checkpoint=True, **{**keys, "max_steps": 4})
    torch.manual_seed(9)
    other = load_model(pissa_cfg(tmp_path / "elsewhere", tiny_model_dir))  # a new SVD, not the run's
    with pytest.raises(TrainingError, match="the model's PiSSA initialization differs"):
        Trainer(cfg, other, None, random_dataset(LENGTHS), None, collate).train()
