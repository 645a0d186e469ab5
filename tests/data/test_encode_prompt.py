"""The RL stages' prompt rows: the conversation up to its last user turn with the generation prompt, the row's
other columns kept for the rewards, room left for the completion, bad rows named."""

from __future__ import annotations

import json

import pytest

from tuneforge.batch import Layout
from tuneforge.data import build
from tuneforge.data.collate import Collator
from tuneforge.data.template import render_prompt, resolve_template
from tuneforge.errors import DataError

GRPO = {"stage": "grpo", "reward_funcs": ["length"], "max_completion_length": 16}


def prompt_text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_alpaca_prompts_keep_the_other_columns(tokenizer, home, tmp_path, make_cfg, write_dataset):
    rows = [{"instruction": "Add 2 and 3.", "input": "Show the sum.", "answer": "5", "output": "2 + 3 = 5"},
            {"instruction": "Name a colour.", "input": "", "answer": None, "output": "blue"}]
    write_dataset(tmp_path, "arith", rows)
    splits = build(make_cfg(tmp_path, dataset="arith", **GRPO), tokenizer)
    first = splits.train[0]
    chat = resolve_template(None, tokenizer)
    expected = render_prompt(tokenizer, chat, [{"role": "user", "content": "Add 2 and 3.\nShow the sum."}])
    assert first["input_ids"] == expected
    assert prompt_text(tokenizer, first["input_ids"]).endswith("<|im_start|>assistant\n")  # the generation prompt
    assert json.loads(first["columns"]) == {"answer": "5", "output": "2 + 3 = 5"}  # the prompt's columns are not kept
    assert splits.stats["dataset_columns"]["arith"] == ["instruction", "input", "answer", "output"]
    assert splits.stats["train_supervised_tokens"] == 0

    batch = Collator(tokenizer.pad_token_id, Layout(rows="prompt"))([splits.train[0], splits.train[1]])
    assert batch.model_inputs == {} and batch.targets["prompt_ids"][0] == expected
    assert batch.targets["columns"][1] == {"answer": None, "output": "blue"}
    assert batch.num_rows == 2 and batch.num_tokens == len(expected) + len(splits.train[1]["input_ids"])


def test_conversations_end_at_their_last_user_turn(tokenizer, home, lf_data_dir, make_cfg):
    splits = build(make_cfg(lf_data_dir, dataset="glaive_toolcall_en_demo", max_samples=4, **GRPO), tokenizer)
    text = prompt_text(tokenizer, splits.train[0]["input_ids"])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user" in text
    assert len(splits.train) == 4


def test_long_prompts_leave_room_for_the_completion(tokenizer, home, tmp_path, make_cfg, write_dataset):
    write_dataset(tmp_path, "long", [{"instruction": "word " * 200, "answer": "1"}])
    splits = build(make_cfg(tmp_path, dataset="long", cutoff_len=64, **GRPO), tokenizer)
    ids = splits.train[0]["input_ids"]
    assert len(ids) == 64 - 16  # cutoff_len - max_completion_length
    assert prompt_text(tokenizer, ids).endswith("<|im_start|>assistant\n")  # the end is kept
    assert splits.stats["datasets"]["long"]["truncated"] == 1


def test_a_row_without_a_question_is_named(tokenizer, home, tmp_path, make_cfg, write_dataset):
    conversations = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
                     {"messages": [{"role": "assistant", "content": "I speak first"}]}]
    write_dataset(tmp_path, "chat", conversations,
                  {"formatting": "sharegpt", "columns": {"messages": "messages"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"}})
    with pytest.raises(DataError, match=r"dataset 'chat' .*row 1: .*(user|assistant)"):
        build(make_cfg(tmp_path, dataset="chat", **GRPO), tokenizer)
    splits = build(make_cfg(tmp_path, dataset="chat", skip_bad_rows=True, **GRPO), tokenizer)
    assert len(splits.train) == 1 and splits.stats["bad_rows"] == 1


def test_an_alpaca_prompt_dataset_needs_no_response_column(tokenizer, home, tmp_path, make_cfg, write_dataset):
    write_dataset(tmp_path, "questions", [{"question": "What is 6 x 7?", "answer": "42"}],
                  {"columns": {"prompt": "question"}})
    splits = build(make_cfg(tmp_path, dataset="questions", **GRPO), tokenizer)
    assert json.loads(splits.train[0]["columns"]) == {"answer": "42"}
