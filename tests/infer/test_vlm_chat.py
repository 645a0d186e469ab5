"""Chat with a vision-language model: images in the conversation reach model.generate as the processor makes them."""

from __future__ import annotations

import pytest
import torch
from infer_helpers import infer_cfg
from PIL import Image
from test_chat import Script, spy_on
from transformers import AutoConfig, AutoModelForImageTextToText

from tuneforge.infer.chat import chat_loop
from tuneforge.infer.engine import Engine
from tuneforge.infer.request import RequestError
from tuneforge.model.processor import load_processor


@pytest.fixture(scope="module")
def engine(loud_vlm):
    with Engine.from_config(infer_cfg(loud_vlm, max_new_tokens=6, image_max_pixels=112 * 112)) as e:
        yield e


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "red.png"
    Image.new("RGB", (90, 60), (200, 30, 60)).save(path)
    return path


def test_an_image_question_is_answered_as_transformers_answers_it(loud_vlm, engine, picture):
    messages = [{"role": "user", "content": "What is this?", "images": [str(picture)]}]
    ours = engine.complete(messages)
    processor = load_processor(loud_vlm, AutoConfig.from_pretrained(loud_vlm))
    parts = [{"role": "user", "content": [{"type": "image", "image": Image.open(picture).convert("RGB")},
                                          {"type": "text", "text": "What is this?"}]}]
    inputs = processor.apply_chat_template(parts, tokenize=True, return_dict=True, return_tensors="pt",
                                           add_generation_prompt=True)
    assert engine.prompt_ids(messages) == inputs["input_ids"][0].tolist()
    model = AutoModelForImageTextToText.from_pretrained(loud_vlm).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert ours.choices[0].text == expected.split("<|im_end|>")[0] and ours.choices[0].text.strip()
    assert ours.prompt_tokens == inputs["input_ids"].shape[1]
    two = engine.complete(messages, n=2)  # two rows, each with the image
    assert [c.text for c in two.choices] == [ours.choices[0].text] * 2


def test_the_chat_attaches_images_to_the_next_question(engine, picture, monkeypatch):
    sent = spy_on(engine, monkeypatch)
    script = Script(f"image {picture}", "image nowhere.png", "Describe it.", "And now?", "exit")
    chat_loop(infer_cfg("unused"), read=script.read, write=script.write, engine=engine)
    shown = "".join(script.shown)
    assert "image PATH" in shown and "Image attached" in shown and "No such file: nowhere.png" in shown
    assert sent[0][-1] == {"role": "user", "content": "Describe it.", "images": [str(picture.resolve())]}
    assert sent[1][0]["images"] == [str(picture.resolve())] and "images" not in sent[1][-1]


def test_a_broken_image_is_a_request_error_naming_it(engine, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_text("not a picture")
    with pytest.raises(RequestError, match=r"image .*bad.png cannot be read"):
        engine.prompt_ids([{"role": "user", "content": "?", "images": [str(bad)]}])


def test_a_text_model_refuses_images(tiny_model_dir, picture):
    with Engine.from_config(infer_cfg(tiny_model_dir)) as text_engine:
        with pytest.raises(RequestError, match="reads text only"):
            text_engine.prompt_ids([{"role": "user", "content": "?", "images": [str(picture)]}])
