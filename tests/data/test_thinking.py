"""Thinking mode: enable_thinking / preserve_thinking reach the chat template in training, and training records
enable_thinking in the chat template saved with the model, so chat, api, eval and export answer as trained."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_template import encode_rows, reference_ids, sharegpt, supervised_runs

from tuneforge.config import from_dict
from tuneforge.data import template
from tuneforge.infer.generation import chat_template

QWEN3 = (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer):
    """The built-in tokenizer (ChatML markers) with Qwen3's published chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3
    return tok


def chat(tok, **options):
    return template.resolve_template(None, tok, **options)


@pytest.mark.parametrize("thinking", [None, True])
def test_thinking_on_learns_the_thought_block(qwen3_tokenizer, thinking):
    ((ids, labels, _),) = encode_rows(qwen3_tokenizer, [sharegpt("What is 2+2?", "4")],
                                      chat=chat(qwen3_tokenizer, enable_thinking=thinking))
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    assert ids == reference_ids(qwen3_tokenizer, messages)
    assert [qwen3_tokenizer.decode(r) for r in supervised_runs(labels)] == [EMPTY_THOUGHT + "4<|im_end|>"]


def test_thinking_off_puts_the_empty_thought_in_the_prompt(qwen3_tokenizer):
    off = chat(qwen3_tokenizer, enable_thinking=False)
    ((ids, labels, _),) = encode_rows(qwen3_tokenizer, [sharegpt("What is 2+2?", "4")], chat=off)
    text = qwen3_tokenizer.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THOUGHT + "4<|im_end|>\n"
    assert [qwen3_tokenizer.decode(r) for r in supervised_runs(labels)] == ["4<|im_end|>"]
    prompt = template.render_prompt(qwen3_tokenizer, off, [{"role": "user", "content": "Hi"}])
    assert qwen3_tokenizer.decode(prompt).endswith("<|im_start|>assistant\n" + EMPTY_THOUGHT)


def test_reasoning_in_the_data_is_learned_with_thinking_and_dropped_without(qwen3_tokenizer):
    row = sharegpt("What is 2+2?", "<think>\n2 and 2 make 4.\n</think>\n\nIt is 4.")
    ((_, labels, _),) = encode_rows(qwen3_tokenizer, [row], chat=chat(qwen3_tokenizer, enable_thinking=True))
    assert [qwen3_tokenizer.decode(r) for r in supervised_runs(labels)] == [
        "<think>\n2 and 2 make 4.\n</think>\n\nIt is 4.<|im_end|>"]
    ((ids, labels, _),) = encode_rows(qwen3_tokenizer, [row], chat=chat(qwen3_tokenizer, enable_thinking=False))
    assert "2 and 2 make 4" not in qwen3_tokenizer.decode(ids)
    assert [qwen3_tokenizer.decode(r) for r in supervised_runs(labels)] == ["It is 4.<|im_end|>"]


def test_thinking_options_are_part_of_the_cache_key(qwen3_tokenizer):
    texts = {chat(qwen3_tokenizer, **o).text(qwen3_tokenizer) for o in
             ({}, {"enable_thinking": True}, {"enable_thinking": False}, {"preserve_thinking": True})}
    assert len(texts) == 4


def test_the_recorded_mode_is_the_default_of_the_saved_template(qwen3_tokenizer):
    recorded = template.with_thinking_recorded(QWEN3, False)
    assert template.recorded_thinking(recorded) is False and template.recorded_thinking(QWEN3) is None
    assert template.with_thinking_recorded(recorded, True) == template.with_thinking_recorded(QWEN3, True)  # replaced
    assert template.with_thinking_recorded(recorded, None) == QWEN3
    messages = [{"role": "user", "content": "Hi"}]
    render = qwen3_tokenizer.apply_chat_template
    assert render(messages, chat_template=recorded, tokenize=False, add_generation_prompt=True).endswith(EMPTY_THOUGHT)
    assert not render(messages, chat_template=recorded, tokenize=False, add_generation_prompt=True,
                      enable_thinking=True).endswith(EMPTY_THOUGHT)  # an explicit option still wins
    plain = "{{ messages[0]['content'] }}"
    assert template.with_thinking_recorded(plain, False) == plain  # a template without the option is left alone


def test_chat_uses_the_mode_the_adapter_was_trained_with(qwen3_tokenizer, tiny_model_dir, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "chat_template.jinja").write_text(template.with_thinking_recorded(QWEN3, False))

    def cfg(**keys):
        return from_dict({"model_name_or_path": str(tiny_model_dir), "adapter_name_or_path": str(adapter), **keys},
                         for_training=False)

    assert chat_template(cfg(), qwen3_tokenizer).thinking is False
    assert chat_template(cfg(enable_thinking=True), qwen3_tokenizer).thinking is True  # the config wins
    assert chat_template(cfg(preserve_thinking=True), qwen3_tokenizer).kwargs == {
        "enable_thinking": False, "preserve_thinking": True}


def test_a_run_without_thinking_saves_and_exports_a_model_that_answers_without_thinking(
        qwen3_tokenizer, tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    from transformers import AutoTokenizer

    from tuneforge.export import export_model
    from tuneforge.workflow import run

    base = tmp_path / "qwen3-style"
    shutil.copytree(tiny_model_dir, base)
    qwen3_tokenizer.save_pretrained(base)
    data = Path(__file__).resolve().parents[2] / "data"
    monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "home"))
    run(from_dict({"model_name_or_path": str(base), "dataset": "alpaca_demo", "dataset_dir": str(data),
                   "output_dir": str(tmp_path / "out"), "max_samples": 4, "cutoff_len": 64, "max_steps": 1,
                   "per_device_train_batch_size": 2, "save_strategy": "no", "disable_tqdm": True,
                   "enable_thinking": False}, source="think.yaml"))
    assert template.recorded_thinking(template.saved_chat_template(tmp_path / "out")) is False

    export_model(from_dict({"model_name_or_path": str(base), "adapter_name_or_path": str(tmp_path / "out"),
                            "export_dir": str(tmp_path / "merged")}, for_training=False))
    exported = AutoTokenizer.from_pretrained(tmp_path / "merged")  # plain transformers, no option given
    prompt = exported.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n" + EMPTY_THOUGHT)
    assert EMPTY_THOUGHT.strip() in (tmp_path / "merged" / "Modelfile").read_text()  # Ollama's prompt too


def test_an_api_request_may_set_the_templates_options(qwen3_tokenizer, tiny_model_dir):
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM

    from tuneforge.config.schema import GenerateArgs
    from tuneforge.infer.api.app import create_app
    from tuneforge.infer.engine import Engine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with Engine(model, qwen3_tokenizer, chat(qwen3_tokenizer), GenerateArgs(do_sample=False, max_new_tokens=2),
                context=256) as engine:
        messages = [{"role": "user", "content": "Hi"}]
        assert not qwen3_tokenizer.decode(engine.prompt_ids(messages)).endswith(EMPTY_THOUGHT)
        ids, _ = engine.prompt(messages, None, {"enable_thinking": False})
        assert qwen3_tokenizer.decode(ids).endswith(EMPTY_THOUGHT)
        client = TestClient(create_app(engine))
        reply = client.post("/v1/chat/completions", json={
            "model": engine.name, "messages": messages, "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_nothink_name_selects_the_models_non_thinking_mode(qwen3_tokenizer):
    assert template.resolve_template("qwen3_nothink", qwen3_tokenizer).thinking is False
    assert template.resolve_template("qwen3_nothink", qwen3_tokenizer, enable_thinking=True).thinking is True
    assert template.resolve_template("qwen3", qwen3_tokenizer).thinking is None
