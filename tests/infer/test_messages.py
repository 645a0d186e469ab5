"""OpenAI messages -> chat-template messages (tuneforge/infer/api/messages.py)."""

import json

import pytest

from tuneforge.infer.api.messages import template_messages, template_tools
from tuneforge.infer.request import RequestError
from tuneforge.infer.tools import ToolSyntax

TEXT = ToolSyntax("json", structured=False)
STRUCTURED = ToolSyntax("hermes", structured=True)
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [
    {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_tool_calls_become_the_text_the_model_writes_when_the_template_cannot_render_them():
    out = template_messages(TURNS, TEXT)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[2] == {"role": "assistant", "content": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})}
    assert out[3] == {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1", "name": "get_weather"}


def test_tool_calls_stay_structured_for_templates_that_render_them():
    out = template_messages(TURNS, STRUCTURED)
    assert out[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert out[2]["content"] == ""


def test_default_system_goes_first_only_without_a_system_message():
    user = [{"role": "user", "content": "hi"}]
    assert template_messages(user, TEXT, default_system="Be kind.")[0] == {"role": "system", "content": "Be kind."}
    assert template_messages(TURNS, TEXT, default_system="Be kind.")[0]["content"] == "Be brief."


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "wizard", "content": "x"}], "messages.0.role"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@"}}]}],
         "messages.0.content.0.input_audio.data"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages.0.content.0.image_url.url"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}], "messages.1.tool_calls.0.function.arguments"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.0.tool_calls"),
        ([{"role": "system", "content": "only a system prompt"}], "messages"),
    ],
)
def test_bad_messages_name_the_field(messages, param):
    with pytest.raises(RequestError) as e:
        template_messages(messages, TEXT)
    assert e.value.param == param


def test_the_rendered_conversation_shows_the_call_and_its_result(tokenizer):
    from tuneforge.data.template import resolve_template
    from tuneforge.infer.generation import render_prompt

    tools = template_tools([{"type": "function", "function": {"name": "get_weather", "description": None}}])
    assert tools == [{"type": "function", "function": {"name": "get_weather"}}]
    ids = render_prompt(tokenizer, resolve_template(None, tokenizer), template_messages(TURNS, TEXT), tools)
    text = tokenizer.decode(ids)
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>' in text
    assert text.endswith('<|im_start|>tool\n{"temperature": 21}<|im_end|>\n<|im_start|>assistant\n')
