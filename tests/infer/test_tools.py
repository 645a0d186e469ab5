"""Tool-call syntaxes (tuneforge/infer/tools.py): parse, hold back while streaming, render, detect."""

import json

import pytest

from tuneforge.data.template import TEMPLATES
from tuneforge.infer.tools import SYNTAXES, ToolCall, ToolSyntax, tool_syntax

NAMES = frozenset({"get_weather", "get_time"})
PARIS = {"city": "Paris"}


def syntax(name):
    return ToolSyntax(name, structured=False)


@pytest.mark.parametrize(
    "name,text,content",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ""),
        ("hermes", 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
                   "</tool_call>", "Let me look."),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
        ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure."),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("json", ' {"name": "get_weather", "arguments": {"city": "Paris"}}', ""),
        ("json", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
    ],
)
def test_one_call_in_each_syntax(name, text, content):
    parsed_content, calls = syntax(name).parse(text, NAMES)
    assert parsed_content == content
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", PARIS)]
    item = calls[0].as_openai()
    assert item["id"].startswith("call_") and item["type"] == "function"
    assert json.loads(item["function"]["arguments"]) == PARIS


@pytest.mark.parametrize("name", SYNTAXES)
def test_every_syntax_accepts_the_bare_json_call_of_llamafactory_data(name):
    _, calls = syntax(name).parse('{"name": "get_time", "arguments": {}}', NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", {})]


def test_several_calls_get_distinct_ids():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    _, calls = syntax("hermes").parse(text, NAMES)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", "The weather is fine."),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),  # broken JSON
        ("hermes", '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>'),  # not offered
        ("json", 'The call would be {"name": "get_weather", "arguments": {}}'),  # not the whole answer
        ("json", '{"name": "get_weather", "arguments": [1, 2]}'),  # arguments not an object
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]not json"),
    ],
)
def test_text_that_is_not_a_valid_call_stays_an_answer(name, text):
    assert syntax(name).parse(text, NAMES) == (text, [])


def test_hold_from_keeps_back_what_may_become_a_call():
    hermes, json_syntax = syntax("hermes"), syntax("json")
    assert hermes.hold_from("Sure, <tool_") == len("Sure, ")
    assert hermes.hold_from("Sure, <tool_call>{") == len("Sure, ")
    assert hermes.hold_from("Sure, no call") == len("Sure, no call")
    assert json_syntax.hold_from("  ") == 0 and json_syntax.hold_from(' {"na') == 0
    assert json_syntax.hold_from("<|python") == 0
    assert json_syntax.hold_from("Hello <tool_call>") == len("Hello <tool_call>")
    assert syntax("mistral").hold_from("ok [TOOL_C") == len("ok ")


@pytest.mark.parametrize("name", SYNTAXES)
def test_rendered_calls_parse_back(name):
    calls = [ToolCall("get_weather", PARIS), ToolCall("get_time", {"zone": "CET"})]
    _, parsed = syntax(name).parse(syntax(name).render(calls), NAMES)
    assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls]


def test_the_syntax_is_read_from_the_template():
    assert tool_syntax("{{ '<tool_call>\\n' }}{% for tool_call in message.tool_calls %}") == ToolSyntax("hermes", True)
    assert tool_syntax("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert tool_syntax("{{- '<|python_tag|>' }}").name == "llama3"
    assert tool_syntax(TEMPLATES["chatml"]) == ToolSyntax("json", False)


def test_the_built_in_tokenizer_template_uses_the_default(tokenizer):
    assert tool_syntax(tokenizer.chat_template) == ToolSyntax("json", False)
