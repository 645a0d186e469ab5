"""LlamaFactory v1 data: typed content parts, per-message loss_weight, dataset specs, chosen / rejected_messages.

A `dataset` value that is a v1 spec YAML or a data file is read as v1 reads it; the rows tokenize as the same
conversation written in our other formats does, and only the messages v1 trains carry labels."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from tuneforge.data import build
from tuneforge.data.encode import IGNORE_INDEX
from tuneforge.data.formats import Conversation
from tuneforge.data.pipeline import mark_supervised
from tuneforge.data.template import ChatTemplate, render
from tuneforge.errors import DataError


def text(value: str) -> dict:
    return {"type": "text", "value": value}


def msg(role: str, *parts: dict, weight: float | None = None) -> dict:
    m = {"role": role, "content": list(parts)}
    if weight is not None:
        m["loss_weight"] = weight
    return m


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def lf_root(tmp_path, monkeypatch, lf_data_dir):
    """A working folder laid out as LlamaFactory's: data/ holds the shared demo files (v1 paths start there)."""
    (tmp_path / "data").symlink_to(lf_data_dir)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_v1_row_trains_only_the_messages_its_loss_weights_say(tokenizer, home, tmp_path, make_cfg):
    row = {"messages": [
        msg("system", text("Be brief."), weight=0.0),
        msg("user", text("Say "), text("hi"), weight=0.0),
        msg("assistant", text("Hi!"), weight=0.0),  # an answer in the history that v1 does not train
        msg("user", text("Again")),
        msg("assistant", text("Hi again!")),  # no loss_weight: v1's default 1.0
    ]}
    data = write_rows(tmp_path / "rows.jsonl", [row])
    sample = build(make_cfg(tmp_path, dataset=data), tokenizer).train[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again"},
                {"role": "assistant", "content": "Hi again!"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    answer = len(tokenizer("Hi again!<|im_end|>", add_special_tokens=False)["input_ids"])
    assert sample["input_ids"] == ids
    assert sample["labels"] == [IGNORE_INDEX] * start + ids[start:start + answer] + [IGNORE_INDEX] * (
        len(ids) - start - answer)


def test_the_shared_v1_sft_demo_loads_and_supervises_each_answer(tokenizer, home, lf_data_dir, make_cfg):
    splits = build(make_cfg(lf_data_dir, dataset=str(lf_data_dir / "v1_sft_demo.jsonl"), cutoff_len=256), tokenizer)
    assert splits.stats["datasets"]["v1_sft_demo"]["samples"] == 500
    first = splits.train[0]
    marked = mark_supervised(tokenizer, first["input_ids"], first["labels"])
    assert marked.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n⟦Hello! I am {{name}}, an AI "
                           "assistant developed by {{author}}. How can I assist you today?<|im_end|>⟧\n")
    assert marked.count("⟦") == 1


def test_a_v1_dataset_spec_reads_its_datasets_with_their_converters(tokenizer, home, lf_root, make_cfg):
    splits = build(make_cfg(lf_root, dataset="data/v1_sft_demo.yaml", cutoff_len=128), tokenizer)
    per = splits.stats["datasets"]
    assert (per["identity"]["rows"], per["alpaca_en_demo"]["rows"]) == (91, 500)  # size: 500 of its 999 rows
    identity = json.loads((lf_root / "data" / "identity.json").read_text())[0]
    marked = mark_supervised(tokenizer, splits.train[0]["input_ids"], splits.train[0]["labels"])
    assert f"user\n{identity['instruction']}<|im_end|>" in marked and f"⟦{identity['output']}<|im_end|>⟧" in marked


def v0_pair(row: dict) -> dict:
    """The same preference pair in our openai ranking layout: the prompt messages, then one answer each."""
    def flat(m: dict) -> dict:
        return {"role": m["role"], "content": "".join(p["value"] for p in m["content"])}

    return {"messages": [flat(m) for m in row["chosen_messages"][:-1]],
            "chosen": flat(row["chosen_messages"][-1]), "rejected": flat(row["rejected_messages"][-1])}


def test_a_v1_preference_row_encodes_like_the_same_v0_row(tokenizer, home, tmp_path, lf_data_dir, make_cfg):
    rows = [json.loads(line) for line in (lf_data_dir / "v1_dpo_demo.jsonl").read_text().splitlines()[:3]]
    v1_file = write_rows(tmp_path / "pairs.jsonl", rows)
    (tmp_path / "v0.json").write_text(json.dumps([v0_pair(r) for r in rows]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"v0": {
        "file_name": "v0.json", "formatting": "openai", "ranking": True,
        "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected"}}}))
    # the same pairs as v1's `pair` converter reads them: chosen / rejected lists of plain messages, via a spec
    pair_rows = [{side: [{"role": m["role"], "content": "".join(p["value"] for p in m["content"])}
                         for m in row[f"{side}_messages"]] for side in ("chosen", "rejected")} for row in rows]
    write_rows(tmp_path / "pair.jsonl", pair_rows)
    (tmp_path / "spec.yaml").write_text("orca:\n  path: pair.jsonl\n  source: local\n  converter: pair\n")
    ours = build(make_cfg(tmp_path, dataset=v1_file, stage="dpo"), tokenizer).train
    converted = build(make_cfg(tmp_path, dataset=str(tmp_path / "spec.yaml"), stage="dpo"), tokenizer).train
    reference = build(make_cfg(tmp_path, dataset="v0", stage="dpo"), tokenizer).train
    assert len(ours) == len(converted) == len(reference) == 3
    for a, c, b in zip(ours, converted, reference, strict=True):
        assert a == b and c == b
        assert any(label != IGNORE_INDEX for label in a["chosen_labels"])


def test_the_shared_v1_dpo_demo_trains_dpo(tokenizer, home, lf_data_dir, make_cfg):
    splits = build(make_cfg(lf_data_dir, dataset=str(lf_data_dir / "v1_dpo_demo.jsonl"), stage="dpo"), tokenizer)
    assert splits.stats["datasets"]["v1_dpo_demo"]["samples"] == 10


@pytest.mark.parametrize(("messages", "problem"), [
    ([msg("user", text("q")), msg("assistant", text("a"), weight=0.5)],
     "messages message 1 has loss_weight 0.5; tuneforge trains a message fully (1) or not at all (0)"),
    ([msg("user", text("q")), msg("assistant", {"type": "picture", "value": "x"})],
     "messages message 1, part 0 has type 'picture'"),
    ([msg("user", text("q")), msg("assistant", text("a"), weight=0)],
     "no assistant message has a loss_weight above 0"),
    ([msg("user", text("q")), msg("bot", text("a"))], "messages message 1 has role 'bot'"),
    ([msg("user", text("q")), msg("assistant", {"type": "tool_call", "value": "{\"name\": \"f\"}"})],
     "messages message 1, part 0: a tool_call must be a JSON object with name and arguments"),
])
def test_bad_v1_rows_name_the_row_and_the_problem(tokenizer, home, tmp_path, make_cfg, messages, problem):
    good = {"messages": [msg("user", text("hello")), msg("assistant", text("hi"))]}
    data = write_rows(tmp_path / "rows.jsonl", [good, {"messages": messages}])
    with pytest.raises(DataError) as e:
        build(make_cfg(tmp_path, dataset=data), tokenizer)
    assert f"dataset 'rows' ({data}), row 1: {problem}" in str(e.value)


def test_media_parts_need_a_model_that_reads_them(tokenizer, home, lf_root, make_cfg):
    with pytest.raises(DataError, match="row 0: the row has image media, but the model reads text only"):
        build(make_cfg(lf_root, dataset="data/v1_multimodal_demo.yaml"), tokenizer)


def test_v1_image_parts_render_like_the_same_v0_row(home, lf_root, make_cfg, vlm_dir, lf_data_dir):
    import torch
    from transformers import AutoConfig

    from tuneforge.data.multimodal import MEDIA_COLUMN, unpack_tensors
    from tuneforge.model.processor import load_processor

    processor = load_processor(vlm_dir, AutoConfig.from_pretrained(vlm_dir))
    keys = {"image_max_pixels": 112 * 112, "max_samples": 2}
    splits = build(make_cfg(lf_root, dataset="data/v1_multimodal_demo.yaml", media_dir=".", **keys),
                   processor.tokenizer, processor)
    ours = splits.train
    # the cache knows the image files the parts name, so a changed picture is tokenized again
    tracked = json.loads((Path(splits.stats["cache_dir"]) / "media_files.json").read_text())
    assert {Path(entry[0]).name for entry in tracked} == {"1.jpg", "2.jpg"}
    v0 = lf_root / "v0"
    v0.mkdir()
    shutil.copy(lf_data_dir / "mllm_demo.json", v0 / "mllm_demo.json")
    (v0 / "mllm_demo_data").symlink_to(lf_data_dir / "mllm_demo_data")
    (v0 / "dataset_info.json").write_text(json.dumps({"mllm": {
        "file_name": "mllm_demo.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    reference = build(make_cfg(v0, dataset="mllm", **keys), processor.tokenizer, processor).train
    for a, b in zip(ours, reference, strict=True):
        assert (a["input_ids"], a["labels"]) == (b["input_ids"], b["labels"])
        assert torch.equal(unpack_tensors(a[MEDIA_COLUMN])["pixel_values"],
                           unpack_tensors(b[MEDIA_COLUMN])["pixel_values"])


REASONING_ROW = {"messages": [msg("user", text("2+2?")),
                              msg("assistant", {"type": "reasoning", "value": "two and two"}, text("4"))]}


def test_reasoning_goes_to_a_template_that_reads_it(tokenizer, tmp_path):
    from tuneforge.data import v1

    own = copy.deepcopy(tokenizer)
    own.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}"
                         "[thought: {{ m.reasoning_content }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    attr = v1.dataset_attrs(write_rows(tmp_path / "r.jsonl", [REASONING_ROW]))[0]
    conv = v1.to_conversation(REASONING_ROW, attr)
    assert conv.messages[-1] == {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
    full, spans = render(own, ChatTemplate("tokenizer", None), conv)
    assert full.endswith("<|im_start|>assistant\n[thought: two and two]4<|im_end|>\n")
    assert full[spans[0][0]:spans[0][1]] == "[thought: two and two]4<|im_end|>"


def test_reasoning_is_think_text_for_a_template_that_does_not_read_it(tokenizer, tmp_path):
    from tuneforge.data import v1

    attr = v1.dataset_attrs(write_rows(tmp_path / "r.jsonl", [REASONING_ROW]))[0]
    conv = v1.to_conversation(REASONING_ROW, attr)
    full, spans = render(tokenizer, ChatTemplate("tokenizer", None), conv)
    assert full[spans[0][0]:spans[0][1]] == "<think>\ntwo and two\n</think>\n\n4<|im_end|>"
    plain = Conversation(messages=[{"role": "user", "content": "2+2?"},
                                   {"role": "assistant", "content": "<think>\ntwo and two\n</think>\n\n4"}])
    assert render(tokenizer, ChatTemplate("tokenizer", None), plain)[0] == full
