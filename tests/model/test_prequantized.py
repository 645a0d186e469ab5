"""Checkpoints saved quantized (config.json carries a quantization_config): adapters train on them through
transformers' own quantizer; what cannot work is refused, naming the reason, before the data or weights load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError, ModelError
from tuneforge.model import load
from tuneforge.model.prequantized import check_prequantized


@pytest.fixture(scope="module")
def saved_4bit_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model saved by transformers in bitsandbytes 4-bit (bitsandbytes runs on the CPU)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = tmp_path_factory.mktemp("tiny-4bit")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quant, device_map={"": "cpu"}
                                         ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture
def gptq_dir(tiny_model_dir, tmp_path):
    """A folder whose config says GPTQ (its backend, optimum + gptqmodel, is not installed here)."""
    out = tmp_path / "tiny-gptq"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    (out / "config.json").write_text(json.dumps(config))
    return out


def cfg(model_dir, tmp_path, **keys):
    return from_dict({"model_name_or_path": str(model_dir), "dataset": "alpaca_demo", "output_dir": str(tmp_path),
                      "finetuning_type": "lora", **keys})


def test_lora_trains_on_a_checkpoint_saved_in_4_bit(saved_4bit_dir, tmp_path, caplog):
    import bitsandbytes as bnb

    with caplog.at_level("INFO", logger="tuneforge.model.load"):
        model = load.load_model(cfg(saved_4bit_dir, tmp_path), device=torch.device("cpu"))
    assert "quantization bitsandbytes 4-bit (saved so)" in caplog.text
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, bnb.nn.Linear4bit)  # the saved 4-bit weights, frozen under the adapter
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize(("keys", "words"), [
    ({"finetuning_type": "full"}, "its weights cannot train, so finetuning_type full cannot work"),
    ({"quantization_bit": 4}, r"already quantized \(bitsandbytes 4-bit\); quantization_bit 4 would quantize it again"),
])
def test_what_cannot_train_on_it_is_refused(saved_4bit_dir, tmp_path, keys, words):
    config = load.load_config(saved_4bit_dir, cfg(saved_4bit_dir, tmp_path).model)
    c = cfg(saved_4bit_dir, tmp_path, **keys)
    with pytest.raises(ConfigError, match=words):
        check_prequantized(config, saved_4bit_dir, c.method.finetuning_type, c.model.quantization_bit)


def test_a_method_whose_backend_is_missing_is_refused_before_anything_loads(gptq_dir, tmp_path, monkeypatch):
    from tuneforge import workflow

    monkeypatch.setattr(workflow, "prepare_data", lambda *a: pytest.fail("data prepared"))
    with pytest.raises(ModelError, match=r"saved quantized \(gptq\), and transformers cannot load it on cpu here: "
                                         r".*optimum.*Install the package it names"):
        workflow.run(cfg(gptq_dir, tmp_path))


def test_inference_applies_the_adapter_unmerged_and_export_refuses_to_merge(saved_4bit_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tuneforge.export import export_model
    from tuneforge.model.inference import load_inference_model

    base = AutoModelForCausalLM.from_pretrained(saved_4bit_dir, device_map={"": "cpu"})
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(adapter)
    keys = {"model_name_or_path": str(saved_4bit_dir), "adapter_name_or_path": str(adapter),
            "export_dir": str(tmp_path / "merged")}
    model = load_inference_model(from_dict(keys, for_training=False), device=torch.device("cpu"))
    assert hasattr(model, "peft_config")  # applied, not merged into the 4-bit weights
    with pytest.raises(ConfigError, match="saved quantized .* an adapter cannot be merged into quantized weights"):
        export_model(from_dict(keys, for_training=False))
