"""The tiny vision- / audio-language folders of tests/mm_families.py: each loads with tuneforge's processor loader and
transformers' AutoModelForMultimodalLM, renders a conversation with one image (one audio clip for Qwen2-Audio) through
the family's own chat template, expands the media placeholder into as many tokens as the processor says, and trains
(a forward with labels gives a finite loss)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mm_families import FAMILIES, build_family, chat_template
from PIL import Image
from transformers import AutoConfig, AutoModelForMultimodalLM

from tuneforge.model.processor import load_processor

pytestmark = pytest.mark.vision
DEMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "llamafactory" / "mllm_demo_data"
SAMPLING_RATE = 16000

# family: (processor class, placeholder the template writes, token it expands to, config attribute of that token's id,
#          model class AutoModelForMultimodalLM picks)
EXPECTED = {
    "qwen2_vl": ("Qwen2VLProcessor", "<|image_pad|>", "<|image_pad|>", "image_token_id",
                 "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "<|image_pad|>", "<|image_pad|>", "image_token_id",
                   "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLProcessor", "<|image_pad|>", "<|image_pad|>", "image_token_id",
                 "Qwen3VLForConditionalGeneration"),
    "llava": ("LlavaProcessor", "<image>", "<image>", "image_token_index", "LlavaForConditionalGeneration"),
    "llava_next": ("LlavaNextProcessor", "<image>", "<image>", "image_token_index",
                   "LlavaNextForConditionalGeneration"),
    "gemma3": ("Gemma3Processor", "<start_of_image>", "<image_soft_token>", "image_token_index",
               "Gemma3ForConditionalGeneration"),
    # SmolVLM-256M-Instruct is an Idefics3 checkpoint on the hub
    "smolvlm": ("Idefics3Processor", "<image>", "<image>", "image_token_id", "Idefics3ForConditionalGeneration"),
    "qwen2_audio": ("Qwen2AudioProcessor", "<|AUDIO|>", "<|AUDIO|>", "audio_token_index",
                    "Qwen2AudioForConditionalGeneration"),
}


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """Each family's folder, built once per session on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def demo_image() -> Image.Image:
    """LlamaFactory's demo image (300 x 168), or a generated one of that size where the shared data is absent."""
    path = DEMO / "1.jpg"
    if path.is_file():
        return Image.open(path).convert("RGB")
    ramp = np.linspace(0, 255, 300, dtype=np.uint8)
    return Image.fromarray(np.stack([np.tile(ramp, (168, 1))] * 3, axis=-1))


def demo_audio() -> np.ndarray:
    """One clip at 16 kHz: the demo 2.wav decoded with soundfile where it is installed; else (as in this project's
    environment, which has no audio decoder) a synthetic 1 s 440 Hz tone."""
    try:
        import soundfile
    except ImportError:
        soundfile = None
    if soundfile is not None and (DEMO / "2.wav").is_file():
        wave, rate = soundfile.read(DEMO / "2.wav", dtype="float32", always_2d=True)
        wave = wave.mean(axis=1)
        if rate != SAMPLING_RATE:
            n = round(len(wave) * SAMPLING_RATE / rate)
            wave = np.interp(np.linspace(0, len(wave) - 1, n), np.arange(len(wave)), wave).astype(np.float32)
        return wave
    t = np.arange(SAMPLING_RATE) / SAMPLING_RATE
    return (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def conversation(media: dict) -> list[dict]:
    return [{"role": "user", "content": [media, {"type": "text", "text": "Who?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Kane."}]}]


@pytest.mark.parametrize("name", FAMILIES)
def test_folder_holds_the_family_processor_template_and_matching_token_ids(family_dir, name):
    path = family_dir(name)
    processor_class, placeholder, expanded, id_attr, _ = EXPECTED[name]
    config = AutoConfig.from_pretrained(path)
    processor = load_processor(path, config)

    assert type(processor).__name__ == processor_class
    assert processor.chat_template == chat_template(name) == (path / "chat_template.jinja").read_text()
    kind = "audio" if name == "qwen2_audio" else "image"
    assert getattr(processor, f"{kind}_token") == placeholder  # what the template writes for one image / clip
    tokenizer = processor.tokenizer
    assert getattr(config, id_attr) == tokenizer.convert_tokens_to_ids(expanded) != tokenizer.unk_token_id
    assert config.get_text_config().vocab_size == len(tokenizer)


@pytest.mark.parametrize("name", FAMILIES)
def test_one_media_conversation_expands_and_trains(family_dir, name):
    path = family_dir(name)
    *_, id_attr, model_class = EXPECTED[name]
    config = AutoConfig.from_pretrained(path)
    processor = load_processor(path, config)
    model = AutoModelForMultimodalLM.from_pretrained(path).eval()
    assert type(model).__name__ == model_class

    if name == "qwen2_audio":
        media = {"type": "audio", "audio": demo_audio()}
    else:
        image = demo_image()
        media = {"type": "image", "image": image}
    inputs = processor.apply_chat_template(conversation(media), tokenize=True, return_dict=True, return_tensors="pt")

    n_media = int((inputs["input_ids"] == getattr(config, id_attr)).sum())
    if name == "qwen2_audio":
        _, expected = model.model.audio_tower._get_feat_extract_output_lengths(inputs["feature_attention_mask"].sum(-1))
        assert n_media == int(expected[0]) > 0
    else:
        expected = processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])["num_image_tokens"]
        assert n_media == expected[0] > 0
        if name == "gemma3":
            assert n_media == config.mm_tokens_per_image

    with torch.no_grad():
        loss = model(**inputs, labels=inputs["input_ids"]).loss
    assert torch.isfinite(loss)
