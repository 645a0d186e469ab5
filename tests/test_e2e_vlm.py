"""A vision-language model through the CLI, as a user runs examples/sft_vlm_lora.yaml (on a tiny random Qwen2-VL):
the output loads with transformers + peft alone, a resumed run and two DDP processes train what one run does."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file
from test_distributed import train
from transformers import AutoModelForImageTextToText, AutoProcessor

from tuneforge.model.processor import load_processor

pytestmark = pytest.mark.e2e
EXAMPLE = "examples/sft_vlm_lora.yaml"
SMALL = ["image_max_pixels=12544", "per_device_train_batch_size=4", "gradient_accumulation_steps=1", "max_steps=4",
         "cutoff_len=512"]


def weights(out):
    return load_file(out / "adapter_model.safetensors")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=0)


def test_the_example_trains_resumes_and_its_output_loads_without_tuneforge(tmp_path, vlm_dir):
    one = tmp_path / "one"
    train(EXAMPLE, one, vlm_dir, *SMALL, "save_strategy=steps", "save_steps=2", "eval_strategy=steps",
          "eval_steps=4")
    results = json.loads((one / "all_results.json").read_text())
    assert results["eval_loss"] > 0 and (one / "checkpoint-2").is_dir()
    config = json.loads((one / "adapter_config.json").read_text())
    assert all(t.startswith("model.language_model.") for t in config["target_modules"])
    assert (one / "processor_config.json").is_file() and (one / "chat_template.jinja").is_file()

    resumed = tmp_path / "resumed"
    train(EXAMPLE, resumed, vlm_dir, *SMALL, "save_strategy=steps", "save_steps=2",
          f"resume_from_checkpoint={one / 'checkpoint-2'}")
    assert_same_weights(one, resumed)

    # transformers + peft alone: the base, the adapter and the saved processor
    try:
        processor = AutoProcessor.from_pretrained(one)
    except ImportError:  # no torchvision here: the processor's video slot cannot load (tuneforge's loader can)
        processor = load_processor(one, AutoModelForImageTextToText.from_pretrained(vlm_dir).config)
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(vlm_dir), one).eval()
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (56, 56), "red")},
                                             {"type": "text", "text": "What is it?"}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                           add_generation_prompt=True)
    with torch.no_grad():
        logits = model(**inputs).logits
        base = model.get_base_model()
        with model.disable_adapter():
            untrained = base(**inputs).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, untrained)


def test_two_ddp_processes_train_what_one_process_trains(tmp_path, vlm_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    train(EXAMPLE, one, vlm_dir, *SMALL)
    train(EXAMPLE, two, vlm_dir, *SMALL[:1], "per_device_train_batch_size=2", *SMALL[2:], processes=2)
    assert_same_weights(one, two)
