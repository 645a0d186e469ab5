"""Every vision-language family tuneforge is tested on, through the same code (no per-family rule): rows are
token-exact with the processor's own apply_chat_template, a batch of rows holds what the processor makes of them,
and the training loss is the model's own loss and reads the pixels."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from mm_families import FAMILIES, build_family
from transformers import AutoConfig, AutoModelForMultimodalLM

from tuneforge.batch import Batch, Layout
from tuneforge.config import from_dict
from tuneforge.data import build
from tuneforge.data.collate import Collator
from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.media import MediaSettings, load_image
from tuneforge.data.multimodal import message_parts
from tuneforge.model import load_model
from tuneforge.model.multimodal import rope_positions
from tuneforge.model.processor import load_processor
from tuneforge.train.objectives.lm import LMObjective

pytestmark = pytest.mark.vision
IMAGE_FAMILIES = [name for name in FAMILIES if name != "qwen2_audio"]  # audio: not read yet
MAX_PIXELS = 112 * 112


@pytest.fixture(scope="module", params=IMAGE_FAMILIES)
def family(request, tmp_path_factory):
    path = build_family(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_processor(path, AutoConfig.from_pretrained(path))


@pytest.fixture
def data(tmp_path, lf_data_dir):
    root = tmp_path / "data"
    shutil.copytree(lf_data_dir / "mllm_demo_data", root / "mllm_demo_data")
    rows = json.loads((lf_data_dir / "mllm_demo.json").read_text())[:3]
    (root / "mm.json").write_text(json.dumps(rows))
    (root / "dataset_info.json").write_text(json.dumps({"mm": {
        "file_name": "mm.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return root, rows


def reference(processor, row, root):
    settings = MediaSettings(media_dir=str(root), image_max_pixels=MAX_PIXELS)
    images = iter([load_image(ref, settings) for ref in row["images"]])
    messages = [{"role": m["role"], "content": [
        {"type": "image", "image": next(images)} if p["type"] == "image" else p
        for p in message_parts(m["content"], {"image": "<image>", "video": "<video>", "audio": "<audio>"})]}
        for m in row["messages"]]
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


def test_rows_batches_and_loss_match_transformers(family, data, home):
    name, path, processor = family
    root, rows = data
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mm", "dataset_dir": str(root), "cutoff_len": 4096,
                     "image_max_pixels": MAX_PIXELS}, for_training=False)
    splits = build(cfg, processor.tokenizer, processor)
    assert len(splits.train) == len(rows), name
    refs = [reference(processor, row, root) for row in rows]
    for i, (row, ref) in enumerate(zip(rows, refs, strict=True)):
        ours = splits.train[i]
        assert ours["input_ids"] == ref["input_ids"][0].tolist(), name
        supervised = processor.tokenizer.decode([t for t, lab in zip(ours["input_ids"], ours["labels"], strict=True)
                                                 if lab != IGNORE_INDEX])
        for answer in (m["content"] for m in row["messages"] if m["role"] == "assistant"):
            assert answer.strip() in supervised, name
    batch = Collator(processor.tokenizer.pad_token_id)([splits.train[0], splits.train[1]])
    for key, value in refs[0].items():
        if key in ("input_ids", "attention_mask"):
            continue
        if value.dim() == 2 and value.shape[1] == refs[0]["input_ids"].shape[1]:  # per token
            assert batch.model_inputs[key][0, : value.shape[1]].tolist() == value[0].tolist(), (name, key)
        else:
            assert torch.equal(batch.model_inputs[key][: value.shape[0]][tuple(slice(0, n) for n in value.shape)],
                               value), (name, key)

    model = load_model(from_dict({"model_name_or_path": str(path), "finetuning_type": "full",
                                  "disable_gradient_checkpointing": True}, for_training=False)).eval()
    inputs = {k: v for k, v in batch.model_inputs.items()}
    labels = batch.targets["labels"]
    objective = LMObjective()
    # transformers alone, with its own sdpa (tuneforge's model may run its padding-free attention)
    plain = AutoModelForMultimodalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ours = objective(model, batch).loss_sum / objective.count(batch)
        theirs = plain(**inputs, labels=labels).loss
        pixels = inputs["pixel_values"].clone()
        pixels[pixels != 0] = 0.5  # a flat grey picture (padding images, all zeros, stay padding)
        blank = dict(inputs, pixel_values=pixels)
        without = objective(model, Batch(blank, {"labels": labels}, Layout())).loss_sum / objective.count(batch)
    assert torch.allclose(ours, theirs, atol=1e-4), name
    assert not torch.allclose(ours, without, atol=1e-5), name


def test_audio_rows_match_transformers(home, tmp_path, lf_data_dir):
    pytest.importorskip("soundfile")
    from tuneforge.data.media import load_audio

    path = build_family("qwen2_audio", tmp_path / "qwen2-audio")
    processor = load_processor(path, AutoConfig.from_pretrained(path))
    rows = json.loads((lf_data_dir / "mllm_audio_demo.json").read_text())
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mllm_audio_demo", "dataset_dir": str(lf_data_dir),
                     "cutoff_len": 4096}, for_training=False)
    splits = build(cfg, processor.tokenizer, processor)
    assert len(splits.train) == len(rows)
    settings = MediaSettings(media_dir=str(lf_data_dir))
    for i, row in enumerate(rows):
        clips = iter([load_audio(ref, settings) for ref in row["audios"]])
        messages = [{"role": m["role"], "content": [
            {"type": "audio", "audio": next(clips)} if p["type"] == "audio" else p
            for p in message_parts(m["content"], {"image": "<image>", "video": "<video>", "audio": "<audio>"})]}
            for m in row["messages"]]
        ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        assert splits.train[i]["input_ids"] == ref["input_ids"][0].tolist()
    batch = Collator(processor.tokenizer.pad_token_id)([splits.train[0], splits.train[1]])
    model = load_model(from_dict({"model_name_or_path": str(path), "finetuning_type": "full",
                                  "disable_gradient_checkpointing": True}, for_training=False)).eval()
    objective = LMObjective()
    with torch.no_grad():
        ours = objective(model, batch).loss_sum / objective.count(batch)
        theirs = model(**batch.model_inputs, labels=batch.targets["labels"]).loss
    assert torch.allclose(ours, theirs, atol=1e-4)


# causal attention over the image tokens: 1-D positions, or 3-D rope ones placed per sample (Gemma 3: two-way)
FLAT_FAMILIES = ("llava", "llava_next", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def test_padding_free_media_batches_give_the_padded_losses_or_stay_padded(family, data, home):
    from tuneforge.workflow import batch_layout

    name, path, processor = family
    root, rows = data
    cfg = from_dict({"model_name_or_path": str(path), "dataset": "mm", "dataset_dir": str(root), "cutoff_len": 4096,
                     "image_max_pixels": MAX_PIXELS, "finetuning_type": "full",
                     "disable_gradient_checkpointing": True}, for_training=False)
    splits = build(cfg, processor.tokenizer, processor)
    model = load_model(cfg).eval()
    layout = batch_layout(cfg, splits, model)
    assert layout.flat == (name in FLAT_FAMILIES), name  # Gemma 3: two-way attention within an image
    if not layout.flat:
        return
    rows_ = [splits.train[i] for i in range(len(splits.train))]
    flat = Collator(processor.tokenizer.pad_token_id, layout, rope=rope_positions(model))(rows_)
    padded = Collator(processor.tokenizer.pad_token_id, Layout())(rows_)
    objective = LMObjective()
    with torch.no_grad():
        ours = objective(model, flat).loss_sum
        reference = objective(model, padded).loss_sum
    assert objective.count(flat) == objective.count(padded)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_packed_rows_give_each_sample_its_own_logits_or_packing_is_refused(family, data, home):
    from tuneforge.errors import DataError
    from tuneforge.model.multimodal import family_media_packing

    name, path, processor = family
    root, rows = data
    keys = {"model_name_or_path": str(path), "dataset": "mm", "dataset_dir": str(root), "cutoff_len": 4096,
            "image_max_pixels": MAX_PIXELS, "packing": True, "finetuning_type": "full",
            "disable_gradient_checkpointing": True}
    cfg = from_dict(keys, for_training=False)
    reason = family_media_packing(AutoConfig.from_pretrained(path))
    assert (reason == "") == (name in FLAT_FAMILIES), (name, reason)
    if reason:
        with pytest.raises(DataError, match="packing cannot put this model's samples in one row"):
            build(cfg, processor.tokenizer, processor, media_packing=reason)
        return
    packed = build(cfg, processor.tokenizer, processor, media_packing="")
    alone = build(from_dict(dict(keys, packing=False), for_training=False), processor.tokenizer, processor)
    assert len(packed.train) == 1 and packed.stats["packing"]  # three samples in one row of 4096
    model = load_model(cfg).eval()
    row = Collator(processor.tokenizer.pad_token_id, Layout(packed=True), rope=rope_positions(model))([packed.train[0]])
    assert "attention_mask" not in row.model_inputs
    with torch.no_grad():
        logits = model(**row.model_inputs, use_cache=False).logits[0]  # a cache turns off the packed mask
        start = 0
        for piece in sorted(range(len(alone.train)), key=lambda i: -len(alone.train[i]["input_ids"])):  # FFD order
            sample = Collator(processor.tokenizer.pad_token_id)([alone.train[piece]])
            own = model(**sample.model_inputs).logits[0]
            torch.testing.assert_close(logits[start : start + own.shape[0]], own, atol=1e-5, rtol=1e-5)
            start += own.shape[0]
    assert start == logits.shape[0]
