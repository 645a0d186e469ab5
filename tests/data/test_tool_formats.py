"""tool_format: tools described in the system message and call turns written in the format's syntax, for templates
that do not render tools; a model's own template that does keeps its way; `tuneforge api` reads the calls back."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_template import encode_rows, supervised_runs

from tuneforge.config.loader import build
from tuneforge.data import template, tool_formats
from tuneforge.data.registry import parse_entry
from tuneforge.errors import ConfigError
from tuneforge.infer.tools import ToolCall

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                         "required": ["city"]}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ROW = {"conversations": [
    {"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": json.dumps(CALL)},
    {"from": "observation", "value": "18 C"}, {"from": "gpt", "value": "It is 18 C."}], "tools": json.dumps(TOOLS)}
ATTR = parse_entry("glaive", {
    "file_name": "x.json", "formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"},
    "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
             "observation_tag": "observation", "function_tag": "function_call"}})


@pytest.mark.parametrize(("fmt", "call_text", "described"), [
    ("default", 'Action: get_weather\nAction Input: {"city": "Paris"}', "> get_weather: Weather of a city"),
    ("qwen", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     '<tools>\n{"type": "function", "function": {"name": "get_weather"'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', '"parameters": dictionary of argument'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "[AVAILABLE_TOOLS]["),
    ("qwen3_5", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     '<tools>\n{"name": "get_weather"'),
    ("ling", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "</tool_call>\ndetailed thinking off"),
])
def test_a_tool_conversation_is_written_in_the_format(bare, fmt, call_text, described):
    chat = template.resolve_template("chatml", bare, tool_format=fmt)
    ((ids, labels, _),) = encode_rows(bare, [ROW], attr=ATTR, chat=chat)
    text = bare.decode(ids)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and described in system
    assert "# Tools\n[" not in text  # the chatml template's own tools listing is not used as well
    runs = [bare.decode(r) for r in supervised_runs(labels)]
    assert runs == [call_text + "<|im_end|>", "It is 18 C.<|im_end|>"]


@pytest.mark.parametrize("fmt", tool_formats.TOOL_FORMATS)
def test_tuneforge_api_reads_the_formats_calls_back(fmt):
    syntax = tool_formats.syntax(fmt)
    calls = [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_time", {})]
    before = "" if fmt == "llama3" else "Let me check.\n"  # llama3's calls are the whole answer
    text, parsed = syntax.parse(before + syntax.render(calls), {"get_weather", "get_time"})
    assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls]
    assert text == before.strip()


def test_a_template_that_renders_tools_keeps_its_own_way(tokenizer, caplog):
    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
    with caplog.at_level("INFO", logger="tuneforge.data.template"):
        chat = template.resolve_template(None, qwen3, tool_format="default")
    assert chat.tool_format is None and "renders tools itself" in caplog.text
    assert template.resolve_template(None, tokenizer, tool_format="qwen").tool_format == "qwen"  # SmolLM2's does not


def test_tool_format_values(tokenizer):
    assert build({"tool_format": "qwen"}).data.tool_format == "qwen"
    with pytest.raises(ConfigError, match="tool_format.*'glm4' is not one of"):
        build({"tool_format": "glm4"})
    texts = {template.resolve_template("chatml", tokenizer, tool_format=f).text(tokenizer) for f in (None, "qwen")}
    assert len(texts) == 2  # part of the cache key


def test_a_vision_language_models_prompts_and_training_get_the_format(vlm_dir):
    """Qwen2-VL's processor template renders no tools: tool_format writes them, in training and in its prompts
    (chat, api, predict), with the processor's list-of-parts messages."""
    from transformers import AutoConfig

    from tuneforge.data import formats, media, multimodal
    from tuneforge.model.processor import load_processor

    processor = load_processor(vlm_dir, AutoConfig.from_pretrained(vlm_dir))
    chat = template.resolve_template(None, processor.tokenizer, tool_format="qwen")
    conv = formats.to_conversation(ROW, ATTR)
    sample = multimodal.render_sample(processor, chat, copy.deepcopy(conv), media.MediaSettings())
    trained = processor.tokenizer.decode(sample.ids)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in trained and '<tools>\n{"type": "function"' in trained.split("<|im_end|>")[0]
    conv.messages = conv.messages[:-1]  # up to the answer after the tool's result
    ids, _ = multimodal.prompt_inputs(processor, conv, media.MediaSettings(), conv.tools, chat)
    prompt = processor.tokenizer.decode(ids)
    assert trained.startswith(prompt) and call in prompt
