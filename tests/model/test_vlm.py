"""Vision-language models: the processor loads without torchvision, the loss reads the images, and the
freeze / lora keys choose the language model, the vision tower and the projector as LlamaFactory's do."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from tuneforge.batch import Batch, Layout
from tuneforge.config import from_dict
from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.media import supported_media
from tuneforge.model import load_model
from tuneforge.model.multimodal import language_model_path, media_parts
from tuneforge.model.processor import load_processor
from tuneforge.train.objectives.lm import LMObjective


def cfg_for(vlm_dir, **keys):
    raw = {"model_name_or_path": str(vlm_dir), "stage": "sft", "dataset": "unused", "output_dir": "unused",
           "disable_gradient_checkpointing": True}
    raw.update(keys)
    return from_dict(raw, for_training=False)


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return load_processor(vlm_dir, AutoConfig.from_pretrained(vlm_dir))


def test_the_processor_loads_and_keeps_its_video_settings_when_saved(vlm_dir, processor, tmp_path):
    assert type(processor).__name__ == "Qwen2VLProcessor" and "image" in supported_media(processor)
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2VLProcessor" and "image_processor" in saved
    try:
        import torchvision  # noqa: F401
    except Exception:  # the processor was built without its video slot: the settings still travel with it
        assert "video_processor" in saved


def test_a_text_model_has_no_processor(tiny_model_dir):
    assert load_processor(tiny_model_dir, AutoConfig.from_pretrained(tiny_model_dir)) is None


def image_batch(processor):
    image = Image.new("RGB", (84, 56), (200, 30, 60))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Color?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Red, mostly."}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    labels = inputs["input_ids"].clone()
    labels[:, : labels.shape[1] // 2] = IGNORE_INDEX
    return dict(inputs), labels


@pytest.mark.parametrize("head", ["fused", "forward"])
def test_the_lm_loss_is_the_models_own_loss_and_reads_the_pixels(vlm_dir, processor, head):
    model = load_model(cfg_for(vlm_dir, finetuning_type="full"))
    model.eval()
    inputs, labels = image_batch(processor)
    batch = Batch(inputs, {"labels": labels}, Layout())
    objective = LMObjective(head=head)
    with torch.no_grad():
        ours = objective(model, batch).loss_sum / objective.count(batch)
        theirs = model(**inputs, labels=labels).loss
        blank = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
        without_image = objective(model, Batch(blank, {"labels": labels}, Layout())).loss_sum / objective.count(batch)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert not torch.allclose(ours, without_image, atol=1e-4)


def trainable(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_the_parts_are_found_from_the_models_structure(vlm_dir):
    model = load_model(cfg_for(vlm_dir, finetuning_type="full"))
    assert language_model_path(model) == "model.language_model"
    assert media_parts(model) == {"tower": ["model.visual.patch_embed", "model.visual.blocks"],
                                  "projector": ["model.visual.merger"]}


def test_full_tuning_freezes_the_tower_and_projector_by_default(vlm_dir):
    names = trainable(load_model(cfg_for(vlm_dir, finetuning_type="full")))
    assert not any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    names = trainable(load_model(cfg_for(vlm_dir, finetuning_type="full", freeze_multi_modal_projector=False,
                                         freeze_language_model=True)))
    assert names and all(n.startswith("model.visual.merger.") for n in names)


def test_freeze_tuning_trains_the_language_models_last_layers(vlm_dir):
    names = trainable(load_model(cfg_for(vlm_dir, finetuning_type="freeze", freeze_trainable_layers=1)))
    assert names and all(n.startswith("model.language_model.layers.1.") for n in names)


def test_lora_all_adapts_the_language_model_unless_the_tower_is_unfrozen(vlm_dir):
    def adapted(model) -> set[str]:
        return {n.rsplit(".lora_A", 1)[0] for n in trainable(model) if ".lora_A" in n}

    names = adapted(load_model(cfg_for(vlm_dir, finetuning_type="lora")))
    assert names and all(".language_model.layers." in n for n in names)
    names = adapted(load_model(cfg_for(vlm_dir, finetuning_type="lora", freeze_vision_tower=False)))
    assert any(".visual.blocks." in n for n in names) and not any(".visual.merger." in n for n in names)
    names = adapted(load_model(cfg_for(vlm_dir, finetuning_type="lora", freeze_multi_modal_projector=False)))
    assert any(".visual.merger." in n for n in names) and not any(".visual.blocks." in n for n in names)
