"""The RL stages on prompts with images (a vision-language model): the prompt rows are token-exact with the processor's
own generation prompt and carry its tensors, sampling reads the pixels exactly as a plain `model.generate` on the
processor's inputs does, and the sampled sequences are scored with the prompt's pixels."""

from __future__ import annotations

import pytest
import torch
from mm_families import shape_prompts
from transformers import AutoConfig, AutoModelForImageTextToText

from tuneforge.batch import Layout
from tuneforge.config import from_dict
from tuneforge.data import build
from tuneforge.data.collate import Collator
from tuneforge.data.media import MediaSettings, load_image
from tuneforge.data.multimodal import MEDIA_COLUMN, message_parts
from tuneforge.infer.generation import completion_generator
from tuneforge.model.processor import load_processor
from tuneforge.rollout import Rollouts

PIXELS = 12544


@pytest.fixture
def setup(vlm_dir, tmp_path, home):
    prompts = shape_prompts(tmp_path / "data")
    cfg = from_dict({"model_name_or_path": str(vlm_dir), "stage": "grpo", "reward_funcs": ["accuracy"],
                     "dataset": "prompts", "dataset_dir": str(tmp_path / "data"), "image_max_pixels": PIXELS,
                     "max_completion_length": 8, "cutoff_len": 512}, for_training=False)
    processor = load_processor(vlm_dir, AutoConfig.from_pretrained(vlm_dir))
    return cfg, processor, prompts, tmp_path / "data"


def reference(processor, prompt, root):
    image = load_image(prompt["images"][0], MediaSettings(media_dir=str(root), image_max_pixels=PIXELS))
    marks = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
    messages = [{"role": "user", "content": [{"type": "image", "image": image} if p["type"] == "image" else p
                                             for p in message_parts(prompt["messages"][0]["content"], marks)]}]
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                         add_generation_prompt=True)


def test_prompt_rows_are_the_processors_generation_prompts_with_their_pixels(setup):
    cfg, processor, prompts, root = setup
    splits = build(cfg, processor.tokenizer, processor)
    assert len(splits.train) == len(prompts)
    batch = Collator(processor.tokenizer.pad_token_id, Layout(rows="prompt"))([splits.train[i] for i in range(2)])
    for i in range(2):
        ref = reference(processor, prompts[i], root)
        assert batch.targets["prompt_ids"][i] == ref["input_ids"][0].tolist()
        assert batch.targets["columns"][i]["answer"] == prompts[i]["answer"]
        assert splits.train[i][MEDIA_COLUMN]
    assert len(batch.targets["prompt_media"]) == 2


def test_sampling_reads_the_pixels_as_plain_generate_does(setup, vlm_dir):
    cfg, processor, prompts, root = setup
    splits = build(cfg, processor.tokenizer, processor)
    batch = Collator(processor.tokenizer.pad_token_id, Layout(rows="prompt"))([splits.train[i] for i in range(3)])
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    generate = completion_generator(cfg, processor.tokenizer, processor)
    ours = generate(model, batch.targets["prompt_ids"], media=batch.targets["prompt_media"], do_sample=False,
                    max_new_tokens=6)
    for i in range(3):  # each prompt alone, through transformers only
        ref = reference(processor, prompts[i], root)
        with torch.no_grad():
            out = model.generate(**ref, do_sample=False, max_new_tokens=6, pad_token_id=processor.tokenizer.pad_token_id)
        theirs = out[0, ref["input_ids"].shape[1]:].tolist()
        stops = set(generate_stop_ids(cfg, processor))
        end = next((k + 1 for k, t in enumerate(theirs) if t in stops), len(theirs))
        assert ours[i] == theirs[:end], i


def generate_stop_ids(cfg, processor):
    return Rollouts(cfg, processor.tokenizer, processor).stop_token_ids


def test_sampled_sequences_carry_the_prompts_pixels_and_rewards_see_one_image_token(setup):
    cfg, processor, _, _ = setup
    splits = build(cfg, processor.tokenizer, processor)
    rows = [splits.train[i] for i in range(2)]
    rollouts = Rollouts(cfg, processor.tokenizer, processor)
    groups = [[{"input_ids": r["input_ids"] + [7, 8], "labels": [-100] * len(r["input_ids"]) + [7, 8]}] * 2
              for r in rows]
    model_inputs, _ = rollouts.collate(groups, Layout(rows="plain"), media=[r[MEDIA_COLUMN] for r in rows])
    alone = Collator(processor.tokenizer.pad_token_id)([{**r, "labels": r["input_ids"]} for r in rows])
    grid = alone.model_inputs["image_grid_thw"]
    assert torch.equal(model_inputs["image_grid_thw"], grid.repeat_interleave(2, dim=0))  # each prompt twice
    assert model_inputs["pixel_values"].shape[0] == 2 * alone.model_inputs["pixel_values"].shape[0]
    text = rollouts.decode(rows[0]["input_ids"], skip_special_tokens=False)
    assert text.count(processor.image_token) == 1 and "<|vision_start|>" in text
