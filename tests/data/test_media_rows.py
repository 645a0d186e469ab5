"""Multimodal sft rows: rendered with the processor's own chat template, token for token; media kept whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tuneforge.batch import Layout
from tuneforge.data import build
from tuneforge.data.collate import Collator
from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.media import MediaSettings, load_image
from tuneforge.data.multimodal import MEDIA_COLUMN, message_parts
from tuneforge.errors import DataError
from tuneforge.model.processor import load_processor

MAX_PIXELS = 112 * 112  # small images: few media tokens per image


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return load_processor(vlm_dir, AutoConfig.from_pretrained(vlm_dir))


@pytest.fixture
def mm_data(tmp_path, lf_data_dir):
    """A dataset folder with LlamaFactory's mllm_demo rows and images (copied, so a test can break a file)."""
    root = tmp_path / "data"
    shutil.copytree(lf_data_dir / "mllm_demo_data", root / "mllm_demo_data")
    rows = json.loads((lf_data_dir / "mllm_demo.json").read_text())
    return root, rows


def write(root: Path, rows: list[dict], name: str = "mm") -> None:
    (root / f"{name}.json").write_text(json.dumps(rows))
    info = {name: {"file_name": f"{name}.json", "formatting": "sharegpt",
                   "columns": {"messages": "messages", "images": "images"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"}}}
    (root / "dataset_info.json").write_text(json.dumps(info))


def reference(processor, row: dict, root: Path):
    """What transformers makes of the row: the processor's apply_chat_template on content parts with the images."""
    settings = MediaSettings(media_dir=str(root), image_max_pixels=MAX_PIXELS)
    images = iter([load_image(ref, settings) for ref in row.get("images", [])])
    messages = []
    for m in row["messages"]:
        parts = message_parts(m["content"], {"image": "<image>", "video": "<video>", "audio": "<audio>"})
        messages.append({"role": m["role"], "content": [
            {"type": "image", "image": next(images)} if p["type"] == "image" else p for p in parts]})
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


def built(make_cfg, processor, root, **keys):
    cfg = make_cfg(root, dataset="mm", image_max_pixels=MAX_PIXELS, **keys)
    return build(cfg, processor.tokenizer, processor)


def test_rows_are_token_exact_with_the_processor_and_supervise_the_answers(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    write(root, rows)
    splits = built(make_cfg, processor, root)
    assert splits.stats["datasets"]["mm"]["samples"] == len(rows)
    tok = processor.tokenizer
    for i, row in enumerate(rows):
        ours = splits.train[i]
        ref = reference(processor, row, root)
        assert ours["input_ids"] == ref["input_ids"][0].tolist()
        from tuneforge.data.multimodal import unpack_tensors

        tensors = unpack_tensors(ours[MEDIA_COLUMN])
        assert torch.equal(tensors["pixel_values"], ref["pixel_values"])
        assert torch.equal(tensors["image_grid_thw"], ref["image_grid_thw"])
        # the labels: each assistant answer and its end of turn, nothing else
        supervised = [t for t, label in zip(ours["input_ids"], ours["labels"], strict=True) if label != IGNORE_INDEX]
        answers = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert tok.decode(supervised) == "".join(answers)
        image_tokens = ours["input_ids"].count(processor.image_token_id)
        merge = processor.image_processor.merge_size ** 2
        assert image_tokens == int(ref["image_grid_thw"].prod(dim=1).sum()) // merge


def test_a_cut_inside_an_image_drops_the_sample_and_counts_it(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    write(root, rows[1:2])  # an image in the first question, a text-only second turn
    whole = built(make_cfg, processor, root).train[0]["input_ids"]
    image = [i for i, t in enumerate(whole) if t == processor.image_token_id]
    with pytest.raises(DataError, match=r"1 could not fit their media in it"):
        built(make_cfg, processor, root, cutoff_len=image[0] + 3, overwrite_cache=True)
    # a cut in the second turn keeps the sample, and every image token
    first_turn_end = whole.index(processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), image[-1] + 1)
    first_turn_end = whole.index(processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), first_turn_end + 1) + 2
    kept = built(make_cfg, processor, root, cutoff_len=first_turn_end + 6, overwrite_cache=True)
    stats = kept.stats["datasets"]["mm"]
    assert stats["truncated"] == 1 and stats["dropped_media_cut"] == 0
    ids = kept.train[0]["input_ids"]
    assert len(ids) == first_turn_end + 6 < len(whole) and ids[: image[-1] + 1] == whole[: image[-1] + 1]


def test_a_placeholder_count_that_does_not_match_the_files_names_the_row(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    rows[1]["images"] = rows[1]["images"] * 2
    write(root, rows)
    with pytest.raises(DataError, match=r"dataset 'mm' .*row 1: the messages hold 1 <image> placeholder\(s\) but "
                                        r"the row's images column lists 2 file\(s\)"):
        built(make_cfg, processor, root)
    skipped = built(make_cfg, processor, root, skip_bad_rows=True)
    assert skipped.stats["datasets"]["mm"]["bad_rows"] == 1 and len(skipped.train) == len(rows) - 1


def test_a_missing_or_broken_image_names_the_file(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    rows[2]["images"] = ["mllm_demo_data/nowhere.jpg"]
    write(root, rows)
    with pytest.raises(DataError, match=r"row 2: image file mllm_demo_data/nowhere.jpg does not exist"):
        built(make_cfg, processor, root)
    (root / "mllm_demo_data" / "3.jpg").write_text("not an image")
    rows[2]["images"] = ["mllm_demo_data/3.jpg"]
    write(root, rows)
    with pytest.raises(DataError, match=r"row 2: image mllm_demo_data/3.jpg cannot be read"):
        built(make_cfg, processor, root, overwrite_cache=True)


def test_images_without_placeholders_go_before_the_first_question(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    row = rows[1]
    row["messages"][0]["content"] = row["messages"][0]["content"].replace("<image>", "")
    write(root, [row])
    ours = built(make_cfg, processor, root).train[0]
    row["messages"][0]["content"] = "<image>" + row["messages"][0]["content"]
    assert ours["input_ids"] == reference(processor, row, root)["input_ids"][0].tolist()


def test_a_batch_is_what_the_processor_makes_of_the_rows_together(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    write(root, rows[:2])
    splits = built(make_cfg, processor, root)
    batch = Collator(processor.tokenizer.pad_token_id)([splits.train[0], splits.train[1]])
    refs = [reference(processor, row, root) for row in rows[:2]]
    width = batch.model_inputs["input_ids"].shape[1]
    for i, ref in enumerate(refs):
        n = ref["input_ids"].shape[1]
        assert batch.model_inputs["input_ids"][i, :n].tolist() == ref["input_ids"][0].tolist()
        assert batch.model_inputs["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
        assert batch.model_inputs["mm_token_type_ids"][i, :n].tolist() == ref["mm_token_type_ids"][0].tolist()
    assert torch.equal(batch.model_inputs["pixel_values"], torch.cat([r["pixel_values"] for r in refs]))
    assert torch.equal(batch.model_inputs["image_grid_thw"], torch.cat([r["image_grid_thw"] for r in refs]))


def test_a_second_build_reads_the_cache_not_the_images(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    write(root, rows)
    first = built(make_cfg, processor, root)
    shutil.rmtree(root / "mllm_demo_data")  # the images are gone; the tokenized rows still hold their pixels
    again = built(make_cfg, processor, root)
    assert again.stats["cache_hit"] and again.train[0][MEDIA_COLUMN] == first.train[0][MEDIA_COLUMN]


def test_an_image_changed_in_place_is_read_again(home, make_cfg, processor, mm_data):
    from PIL import Image

    root, rows = mm_data
    write(root, rows[:1])
    first = built(make_cfg, processor, root)
    assert built(make_cfg, processor, root).stats["cache_hit"]
    picture = root / rows[0]["images"][0]
    Image.new("RGB", Image.open(picture).size, "red").save(picture)  # same name, new pixels
    again = built(make_cfg, processor, root)
    assert not again.stats["cache_hit"] and again.train[0][MEDIA_COLUMN] != first.train[0][MEDIA_COLUMN]
    assert built(make_cfg, processor, root).stats["cache_hit"]  # and the new build is the cache from now on


def test_the_preview_shows_where_the_image_goes_and_what_is_learned(home, make_cfg, processor, mm_data):
    from tuneforge.data import preview

    root, rows = mm_data
    write(root, rows[1:2])
    text = preview(make_cfg(root, dataset="mm", image_max_pixels=MAX_PIXELS), processor.tokenizer, n=1,
                   processor=processor)[0]
    count = built(make_cfg, processor, root).train[0]["input_ids"].count(processor.image_token_id)
    assert f"<|vision_start|><|image_pad|>×{count}<|vision_end|>Who is he?" in text
    assert "⟦He's Thomas Muller from Bayern Munich.<|im_end|>⟧" in text


@pytest.mark.parametrize("name", ["mllm_video_demo", "mllm_audio_demo"])
def test_videos_and_audio_stop_before_tokenizing(home, make_cfg, processor, lf_data_dir, name):
    with pytest.raises(DataError, match=rf"dataset '{name}' holds (videos|audios?)"):
        build(make_cfg(lf_data_dir, dataset=name), processor.tokenizer, processor)


def pair_rows(rows: list[dict]) -> list[dict]:
    """Ranking rows in sharegpt form: the first question (with its image), a chosen and a rejected answer."""
    return [{"messages": [r["messages"][0]], "images": r["images"][:1],
             "chosen": {"role": "assistant", "content": r["messages"][1]["content"]},
             "rejected": {"role": "assistant", "content": "I cannot tell."}} for r in rows]


def write_pairs(root: Path, rows: list[dict], kto: bool = False) -> None:
    columns = {"messages": "messages", "images": "images"}
    entry = {"file_name": "pairs.json", "formatting": "sharegpt", "columns": columns,
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
    if kto:
        columns["kto_tag"] = "label"
    else:
        entry["ranking"] = True
        columns.update(chosen="chosen", rejected="rejected")
    (root / "pairs.json").write_text(json.dumps(rows))
    (root / "dataset_info.json").write_text(json.dumps({"pairs": entry}))


def test_preference_rows_carry_the_prompts_image_in_each_sequence(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    pairs = pair_rows(rows[:3])
    write_pairs(root, pairs)
    from tuneforge.data.multimodal import unpack_tensors

    splits = build(make_cfg(root, dataset="pairs", stage="dpo", image_max_pixels=MAX_PIXELS), processor.tokenizer,
                   processor)
    for i, pair in enumerate(pairs):
        for side in ("chosen", "rejected"):
            row = {"messages": pair["messages"] + [pair[side]], "images": pair["images"]}
            ref = reference(processor, row, root)
            assert splits.train[i][f"{side}_input_ids"] == ref["input_ids"][0].tolist()
            tensors = unpack_tensors(splits.train[i][f"{side}_{MEDIA_COLUMN}"])
            assert torch.equal(tensors["pixel_values"], ref["pixel_values"])
    batch = Collator(processor.tokenizer.pad_token_id, Layout(rows="pairwise"))([splits.train[0], splits.train[1]])
    grids = batch.model_inputs["image_grid_thw"]
    first = [unpack_tensors(splits.train[i][f"{s}_{MEDIA_COLUMN}"])["image_grid_thw"]
             for s in ("chosen", "rejected") for i in (0, 1)]  # sequences: chosen 0, chosen 1, rejected 0, rejected 1
    assert torch.equal(grids, torch.cat(first))


def test_kto_rows_render_the_image_with_the_answer_and_its_kl_pair(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    feedback = [{"messages": r["messages"][:2], "images": r["images"][:1], "label": i % 2 == 0}
                for i, r in enumerate(rows[:3])]
    write_pairs(root, feedback, kto=True)
    splits = build(make_cfg(root, dataset="pairs", stage="kto", image_max_pixels=MAX_PIXELS), processor.tokenizer,
                   processor)
    ref = reference(processor, feedback[0], root)
    assert splits.train[0]["input_ids"] == ref["input_ids"][0].tolist()
    kl = {"messages": [feedback[0]["messages"][0], feedback[1]["messages"][1]], "images": feedback[0]["images"]}
    assert splits.train[0]["kl_input_ids"] == reference(processor, kl, root)["input_ids"][0].tolist()


def test_llamafactorys_template_name_for_the_family_uses_the_processors_own(home, make_cfg, processor, mm_data):
    root, rows = mm_data
    write(root, rows[:1])
    named = built(make_cfg, processor, root, template="qwen2_vl").train[0]["input_ids"]
    assert named == reference(processor, rows[0], root)["input_ids"][0].tolist()
    with pytest.raises(DataError, match="is a text template"):
        built(make_cfg, processor, root, template="alpaca", overwrite_cache=True)


def test_media_rows_built_in_two_processes_are_the_ones_built_in_one(home, make_cfg, processor, mm_data, monkeypatch):
    root, rows = mm_data
    write(root, rows)
    one = built(make_cfg, processor, root, preprocessing_num_workers=1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("tuneforge.data.pipeline.AUTO_ROWS_PER_WORKER", 2)  # unset: 6 rows, two processes
    two = built(make_cfg, processor, root, overwrite_cache=True)
    assert two.stats["cache_hit"] is False
    assert [dict(r) for r in two.train] == [dict(r) for r in one.train]
