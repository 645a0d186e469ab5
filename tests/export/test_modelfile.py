"""The Modelfile TEMPLATE, rendered as Ollama renders it (a Go-template renderer of the constructs it uses),
gives the same prompt as the Jinja chat template with add_generation_prompt=True."""

from __future__ import annotations

import pytest
from go_template import modelfile_blocks, ollama_prompt, render_go

from tuneforge.config.schema import GenerateArgs
from tuneforge.data.template import TEMPLATES
from tuneforge.export.modelfile import go_template, modelfile
from tuneforge.export.turns import derive_turns

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr, hello!"},
        {"role": "user", "content": "Where is the treasure?\nTell me {{ now }}."},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


def _modelfile(tokenizer, source, system=None):
    turns = derive_turns(tokenizer, source)
    assert turns is not None
    text, notes = modelfile(".", turns, system=system, stops=["<|im_end|>"], gen=GenerateArgs())
    assert notes == []
    return text


@pytest.mark.parametrize("name", [None, "chatml", "llama3"])
def test_template_renders_like_the_chat_template(tokenizer, name):
    source = TEMPLATES[name] if name else None  # None: SmolLM2's own template
    text = _modelfile(tokenizer, source)
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                 add_generation_prompt=True)
        assert ollama_prompt(text, messages) == expected, messages


def test_tool_results_render_like_the_chat_template(tokenizer):
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
                {"role": "tool", "content": "sunny"}]
    for source in (None, TEMPLATES["chatml"], TEMPLATES["llama3"]):
        expected = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                 add_generation_prompt=True)
        assert ollama_prompt(_modelfile(tokenizer, source), messages) == expected


def test_smollm2_default_system_prompt_becomes_system(tokenizer):
    text = _modelfile(tokenizer, None)
    assert modelfile_blocks(text)["SYSTEM"] == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert "SYSTEM" not in modelfile_blocks(_modelfile(tokenizer, TEMPLATES["chatml"]))
    assert modelfile_blocks(_modelfile(tokenizer, None, system="Be brief."))["SYSTEM"] == "Be brief."


def test_final_assistant_message_is_left_open(tokenizer):
    """Ollama continues a last assistant message: the template must not close it."""
    text = _modelfile(tokenizer, TEMPLATES["chatml"])
    prompt = ollama_prompt(text, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}])
    assert prompt.endswith("<|im_start|>assistant\nHel")


def test_go_braces_in_template_text_stay_literal():
    from tuneforge.export.turns import TurnFormat

    turns = TurnFormat("", ("{{sys}}", "\n"), ("U: ", "\n"), ("A: ", "\n"), None, "A: ", None)
    assert render_go(go_template(turns), {"System": "s", "Messages": []}) == "{{sys}}s\n"


def test_template_that_is_not_fixed_text_gets_no_template_line(tokenizer):
    joined = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if not loop.last %} | {% endif %}"
              "{% endfor %}{% if add_generation_prompt %} => {% endif %}")
    assert derive_turns(tokenizer, joined) is None
    text, notes = modelfile(".", None, system=None, stops=[], gen=GenerateArgs())
    assert "TEMPLATE" not in text and "FROM ." in text and "no TEMPLATE line" in notes[0]
