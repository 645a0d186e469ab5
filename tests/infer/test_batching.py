"""Continuous batching in the engine (tuneforge/infer/batching.py): concurrent requests share forward passes and
answer as they do one at a time. A tiny random Llama in fp32 with large weights, so that its greedy answers vary
from token to token (a small random model repeats one token, which would prove little)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from infer_helpers import api_server, infer_cfg, save_tiny_llama

from tuneforge.infer.engine import Engine
from tuneforge.infer.job import Delta, Done, Finish

QUESTIONS = [f"Tell me about the number {i}." + " Please." * (i % 3) for i in range(8)]  # prompts of 3 lengths


def ask(i):
    return [{"role": "user", "content": QUESTIONS[i]}]


@pytest.fixture(scope="module")
def varied_model_dir(tmp_path_factory, tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-varied"), tokenizer, max_position_embeddings=2048,
                           initializer_range=0.5)


@pytest.fixture(scope="module")
def batched(varied_model_dir):
    engine = Engine.from_config(infer_cfg(varied_model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def one_at_a_time(batched):
    """The same model served one request at a time (the engine before batching)."""
    engine = Engine(batched.lm, batched.tokenizer, batched.template, batched.gen, context=batched.context, max_batch=1)
    yield engine
    engine.close()


def concurrently(fn, count):
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(fn, range(count)))


def test_concurrent_greedy_answers_share_forward_passes_and_equal_one_at_a_time(batched, one_at_a_time):
    alone = [one_at_a_time.complete(ask(i), max_tokens=20).choices[0] for i in range(len(QUESTIONS))]
    assert one_at_a_time.batch_rows() == {} and one_at_a_time.stats["batched"] == 0
    assert all(len(set(batched.tokenizer(c.text)["input_ids"])) > 5 for c in alone)  # answers that vary
    before = batched.stats["batched"]
    together = concurrently(lambda i: batched.complete(ask(i), max_tokens=20).choices[0], len(QUESTIONS))
    assert [(c.text, c.tokens, c.finish_reason) for c in together] == \
        [(c.text, c.tokens, c.finish_reason) for c in alone]
    assert batched.stats["batched"] - before == len(QUESTIONS)
    assert max(batched.batch_rows()) > 1  # several requests went through one forward pass


def test_a_seeded_sample_is_unchanged_while_other_requests_run(batched, one_at_a_time):
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 16, "n": 2}
    alone = one_at_a_time.complete(ask(0), **seeded)
    busy = threading.Event()

    def traffic(i):  # unseeded samples and greedy answers, batched, around the seeded request
        busy.set()
        return batched.complete(ask(i), max_tokens=40, temperature=0.9 if i % 2 else 0).choices[0].tokens

    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(traffic, i) for i in range(6)]
        busy.wait()
        again = batched.complete(ask(0), **seeded)
        assert all(f.result() > 0 for f in others)
    assert [c.text for c in again.choices] == [c.text for c in alone.choices]
    assert again.choices[0].text != again.choices[1].text


def test_streamed_pieces_come_in_order_and_join_to_the_answer(batched):
    whole = batched.complete(ask(3), max_tokens=20, n=2).choices

    def stream(_):
        return list(batched.stream(ask(3), max_tokens=20, n=2))

    for events in concurrently(stream, 3):
        assert isinstance(events[-1], Done) and events[-1].completion_tokens == 40
        for index in (0, 1):
            mine = [e for e in events if getattr(e, "index", None) == index]
            assert isinstance(mine[-1], Finish) and all(isinstance(e, Delta) for e in mine[:-1])
            assert "".join(e.text for e in mine[:-1]) == whole[index].text


def test_cancelling_one_request_leaves_the_others_running(batched):
    before = dict(batched.stats)
    streams = [batched.stream(ask(i), max_tokens=300) for i in range(3)]
    for s in streams:
        assert isinstance(next(s), Delta)
    streams[1].close()  # its client went away
    rest = [list(streams[i]) for i in (0, 2)]
    assert all(events[-1] == Done(len(batched.prompt_ids(ask(i))), 300) for events, i in zip(rest, (0, 2), strict=True))
    deadline = time.monotonic() + 30
    while batched.stats["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batched.stats["cancelled"] == before["cancelled"] + 1
    assert batched.stats["finished"] == before["finished"] + 2
    assert batched.stats["generated_tokens"] - before["generated_tokens"] - 600 < 100  # the cancelled one stopped early


def test_stop_strings_cut_batched_answers(batched, one_at_a_time):
    text = one_at_a_time.complete(ask(5), max_tokens=24).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = concurrently(lambda _: batched.complete(ask(5), max_tokens=24, stop=[stop, "never-xyz"]).choices[0], 3)
    assert all(c.text == text[: text.find(stop)] and c.finish_reason == "stop" for c in cut)


def test_unseeded_samples_of_n_answers_differ(batched):
    answer = batched.complete(ask(1), max_tokens=16, temperature=1.0, n=3)
    assert len({c.text for c in answer.choices}) == 3
    assert answer.completion_tokens == sum(c.tokens for c in answer.choices) == 48


def test_a_hundred_concurrent_api_requests_all_succeed(batched):
    with api_server(batched, api_key="k") as url:
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=120)

        def one(i):
            r = client.chat.completions.create(model=batched.name, messages=ask(i % len(QUESTIONS)), max_tokens=4,
                                               temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens

        answers = concurrently(one, 100)
    alone = [batched.complete(ask(i), max_tokens=4).choices[0].text for i in range(len(QUESTIONS))]
    assert [a for a, _ in answers] == [alone[i % len(QUESTIONS)] for i in range(100)]
    assert all(tokens == 4 for _, tokens in answers)


def test_infer_max_batch_one_answers_one_at_a_time_and_zero_is_refused_before_loading(varied_model_dir):
    from tuneforge.errors import ConfigError

    with Engine.from_config(infer_cfg(varied_model_dir, infer_max_batch=1)) as engine:
        assert concurrently(lambda i: engine.complete(ask(i), max_tokens=4).choices[0].tokens, 3) == [4, 4, 4]
        assert engine.stats["batched"] == 0 and engine.batch_rows() == {}
    with pytest.raises(ConfigError, match="infer_max_batch must be >= 1"):
        Engine.from_config(infer_cfg(varied_model_dir / "missing", infer_max_batch=0))
