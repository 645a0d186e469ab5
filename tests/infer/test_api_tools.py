"""Tool calls end to end: a tiny model fine-tuned by tuneforge on one tool-using conversation, served
greedy, asked through the openai client; the call it writes comes back as tool_calls, and the call and
its result sent back in produce the answer it learned."""

import json

import openai
import pytest
from infer_helpers import CALL, FINAL, QUESTION, RESULT, TOOLS, api_server, infer_cfg

OPENAI_TOOLS = [{"type": "function", "function": t} for t in TOOLS]
ASK = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def tool_engine(tool_model_dir):
    from tuneforge.infer.engine import Engine

    engine = Engine.from_config(infer_cfg(tool_model_dir, max_new_tokens=40))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(tool_engine):
    with api_server(tool_engine) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def test_a_tool_call_comes_back_as_tool_calls(client, tool_engine):
    choice = client.chat.completions.create(model=tool_engine.name, messages=ASK, tools=OPENAI_TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]


def test_a_streamed_tool_call(client, tool_engine):
    chunks = list(client.chat.completions.create(model=tool_engine.name, messages=ASK, tools=OPENAI_TOOLS,
                                                 stream=True))
    assert not any(c.choices[0].delta.content for c in chunks)  # the call's raw text is never shown
    (delta,) = [c.choices[0].delta for c in chunks if c.choices[0].delta.tool_calls]
    (call,) = delta.tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_call_and_its_result_are_rendered_back_in(client, tool_engine):
    first = client.chat.completions.create(model=tool_engine.name, messages=ASK, tools=OPENAI_TOOLS).choices[0]
    call = first.message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(model=tool_engine.name, messages=messages, tools=OPENAI_TOOLS).choices[0]
    assert answer.message.content == FINAL and answer.finish_reason == "stop"  # it stopped at <|im_end|>
    assert not answer.message.tool_calls


def test_without_tools_or_with_tool_choice_none_the_text_is_the_answer(client, tool_engine):
    for extra in ({}, {"tools": OPENAI_TOOLS, "tool_choice": "none"}):
        choice = client.chat.completions.create(model=tool_engine.name, messages=ASK, **extra).choices[0]
        assert json.loads(choice.message.content) == CALL and choice.finish_reason == "stop"


def test_scoring_needs_a_reward_model(client, tool_engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/score/evaluation", body={"model": tool_engine.name, "messages": ["hi"]}, cast_to=object)
    assert e.value.response.json()["error"]["code"] == "model_not_reward_model"
