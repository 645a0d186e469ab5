"""`tuneforge api` through the official openai client, on a tiny reward model (it chats and scores),
served from a background thread on 127.0.0.1 with an API key."""

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from infer_helpers import api_server

KEY = "test-key-123"
HI = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def base_url(rm_engine):
    with api_server(rm_engine, api_key=KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(rm_engine):
    return rm_engine.name


def post(url, body: bytes, key=KEY):
    """(status, parsed JSON body) of a raw POST."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_plain_and_streamed_answers_agree(client, model, rm_engine):
    sampled = {"temperature": 1.0, "seed": 5}  # the random model's greedy answer is one repeated token
    plain = client.chat.completions.create(model=model, messages=HI, max_tokens=12, **sampled)
    assert plain.object == "chat.completion" and plain.choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(rm_engine.prompt_ids(HI))
    assert plain.usage.completion_tokens == 12 and plain.usage.total_tokens == plain.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(model=model, messages=HI, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **sampled))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == plain.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_the_stream_is_server_sent_events_ending_with_done(base_url, model):
    body = json.dumps({"model": model, "messages": HI, "max_tokens": 3, "stream": True}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_n_samples_with_a_seed_are_reproducible(client, model):
    def ask():
        return client.chat.completions.create(model=model, messages=HI, n=2, temperature=1.0, top_p=0.9,
                                              seed=11, max_tokens=10)

    first, again = ask(), ask()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 20


def test_stop_string_or_list(client, model):
    def ask(**kw):
        return client.chat.completions.create(model=model, messages=HI, temperature=1.0, seed=3, max_tokens=16,
                                              **kw).choices[0]

    text = ask().message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for option in (stop, [stop, "zz-never-zz"]):
        choice = ask(stop=option)
        assert choice.message.content == text[: text.find(stop)] and choice.finish_reason == "stop"


BAD = {
    "unknown model": ({"model": "gpt-9"}, 404, "model"),
    "empty messages": ({"messages": []}, 400, "messages"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    "prompt over the context": ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    "max_tokens 0": ({"max_tokens": 0}, 400, "max_tokens"),
    "max_completion_tokens -1": ({"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    "n 0": ({"n": 0}, 400, "n"),
    "temperature 3": ({"temperature": 3}, 400, "temperature"),
    "empty stop": ({"stop": [""]}, 400, "stop"),
    "logprobs": ({"logprobs": True}, 400, None),
    "no messages": ({"messages": None}, 400, "messages"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, model, case):
    change, status, param = BAD[case]
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**{"model": model, "messages": HI, "max_tokens": 4, **change})
    assert e.value.status_code == status
    error = e.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]
    assert client.chat.completions.create(model=model, messages=HI, max_tokens=2).choices[0].message.content


def test_malformed_json_and_unknown_routes(base_url, client, model):
    status, body = post(f"{base_url}/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(f"{base_url}/nowhere", b"{}")
    assert status == 404 and body["error"]["message"]
    assert client.chat.completions.create(model=model, messages=HI, max_tokens=2).choices


def test_a_missing_or_wrong_key_is_refused(base_url, model):
    wrong = openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=model, messages=HI, max_tokens=2)
    for key in ("wrong-key", None):  # checked before the body is read
        status, body = post(f"{base_url}/chat/completions", b"not even json", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    try:
        urllib.request.urlopen(f"{base_url}/models", timeout=60)
        raise AssertionError("GET /v1/models without a key was served")
    except urllib.error.HTTPError as e:
        assert e.code == 401 and "missing API key" in json.loads(e.read())["error"]["message"]


def test_twenty_concurrent_clients_get_their_own_answers(client, model):
    """Four different requests (prompt and seed), five clients each, half of them streaming: every answer
    equals the one a single client got, so no two requests shared a batch, an RNG draw or a stream."""
    prompts = [[{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}] for i in range(4)]
    options = {"max_tokens": 8, "temperature": 1.0}

    def ask(i):
        request = {"model": model, "messages": prompts[i % 4], "seed": i % 4, **options}
        if i % 2:
            stream = client.chat.completions.create(**request, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return client.chat.completions.create(**request).choices[0].message.content

    expected = [ask(i) for i in range(4)]
    assert len(set(expected)) == 4  # different requests, different answers: a mix-up would show
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    assert answers == [expected[i % 4] for i in range(20)]


def test_an_abandoned_stream_stops_generating(client, model, rm_engine):
    before = dict(rm_engine.stats)
    stream = client.chat.completions.create(model=model, messages=HI, max_tokens=3000, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()  # the client goes away
    deadline = time.monotonic() + 30
    while rm_engine.stats["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rm_engine.stats["cancelled"] == before["cancelled"] + 1
    assert rm_engine.stats["generated_tokens"] - before["generated_tokens"] < 1000
    assert client.chat.completions.create(model=model, messages=HI, max_tokens=2).choices  # still serving


def test_an_abandoned_plain_request_stops_generating(base_url, model, rm_engine):
    before = dict(rm_engine.stats)
    host, port = base_url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": model, "messages": HI, "max_tokens": 3000}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while rm_engine.stats["requests"] == before["requests"] and time.monotonic() < deadline:
            time.sleep(0.01)  # until the generation runs
    deadline = time.monotonic() + 30
    while rm_engine.stats["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rm_engine.stats["cancelled"] == before["cancelled"] + 1
    assert rm_engine.stats["generated_tokens"] - before["generated_tokens"] < 1000


def test_score_route_scores_texts_with_the_value_head(base_url, model, rm_engine):
    texts = ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>", "short", "a b c d e f"]
    status, body = post(f"{base_url}/score/evaluation", json.dumps({"model": model, "messages": texts}).encode())
    assert status == 200 and body["object"] == "score.evaluation" and body["model"] == model
    tok = rm_engine.tokenizer
    with torch.no_grad():
        for text, score in zip(texts, body["scores"], strict=True):
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            assert score == pytest.approx(rm_engine.scorer(input_ids=ids, sequence_ends=torch.tensor(
                [ids.shape[1] - 1])).item(), abs=1e-5)
    status, body = post(f"{base_url}/score/evaluation", json.dumps({"model": model, "messages": []}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
