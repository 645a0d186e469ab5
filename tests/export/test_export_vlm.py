"""Exporting a vision-language model: the merged folder holds its processor and computes what base + adapter do."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText

from tuneforge.config import from_dict
from tuneforge.errors import ConfigError
from tuneforge.export import export_model
from tuneforge.model import load_model
from tuneforge.model.processor import load_processor


@pytest.fixture(scope="module")
def vlm_adapter(vlm_dir, tmp_path_factory):
    """A LoRA adapter on the tiny Qwen2-VL with non-zero B matrices (so merging changes the outputs)."""
    torch.manual_seed(1)
    model = load_model(from_dict({"model_name_or_path": str(vlm_dir), "finetuning_type": "lora",
                                  "disable_gradient_checkpointing": True}, for_training=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    out = tmp_path_factory.mktemp("vlm-lora")
    model.save_pretrained(out)
    return out


def config(vlm_dir, adapter, target, **keys):
    raw = {"model_name_or_path": str(vlm_dir), "adapter_name_or_path": str(adapter), "finetuning_type": "lora",
           "export_dir": str(target), "infer_dtype": "float32", **keys}
    return from_dict(raw, source="export.yaml", for_training=False)


def test_the_merged_folder_loads_with_its_processor_and_matches_base_plus_adapter(vlm_dir, vlm_adapter, tmp_path):
    from peft import PeftModel

    target = tmp_path / "merged"
    result = export_model(config(vlm_dir, vlm_adapter, target))
    assert any("no Modelfile" in line for line in result["summary"])
    assert (target / "processor_config.json").is_file() and (target / "chat_template.jinja").is_file()
    processor = load_processor(target, AutoConfig.from_pretrained(target))
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (56, 84), "blue")},
                                             {"type": "text", "text": "What is it?"}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                           add_generation_prompt=True)
    merged = AutoModelForImageTextToText.from_pretrained(target).eval()
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(vlm_dir), vlm_adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, adapted(**inputs).logits, atol=1e-4, rtol=1e-4)


def test_gguf_of_a_vision_language_model_is_refused_before_loading(vlm_dir, vlm_adapter, tmp_path):
    with pytest.raises(ConfigError, match="projector file"):
        export_model(config(vlm_dir, vlm_adapter, tmp_path / "g", export_format="gguf"))
