"""The generation engine (tuneforge/infer/engine.py) on a tiny random Llama with a value head."""

import time
from dataclasses import replace

import pytest
import torch
from infer_helpers import infer_cfg

from tuneforge.errors import ConfigError
from tuneforge.infer.engine import Engine
from tuneforge.infer.job import Delta, Done, Finish
from tuneforge.infer.request import PromptTooLongError, RequestError

HI = [{"role": "user", "content": "Hello, who are you?"}]


def sampled(engine, **options):
    return engine.complete(HI, temperature=1.0, seed=7, max_tokens=16, **options)


def test_streamed_pieces_join_to_the_whole_answer_and_tokens_are_counted(rm_engine):
    whole = rm_engine.complete(HI, max_tokens=12, temperature=1.0, seed=5)
    events = list(rm_engine.stream(HI, max_tokens=12, temperature=1.0, seed=5))
    deltas = [e for e in events if isinstance(e, Delta)]
    assert len(deltas) > 1 and "".join(d.text for d in deltas) == whole.choices[0].text
    assert [type(e) for e in events[-2:]] == [Finish, Done]
    assert events[-2] == Finish(0, "length", 12)
    assert whole.prompt_tokens == len(rm_engine.prompt_ids(HI)) and whole.completion_tokens == 12


def test_a_seed_reproduces_n_samples(rm_engine):
    first, again = sampled(rm_engine, n=2), sampled(rm_engine, n=2)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # two samples, not one copied
    assert first.completion_tokens == sum(c.tokens for c in first.choices)
    streamed = {}
    for e in rm_engine.stream(HI, temperature=1.0, seed=7, max_tokens=16, n=2):
        if isinstance(e, Delta):
            streamed[e.index] = streamed.get(e.index, "") + e.text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]


def test_stop_strings_cut_the_answer(rm_engine):
    text = sampled(rm_engine).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = sampled(rm_engine, stop=[stop, "never-generated-xyz"]).choices[0]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"


def test_a_prompt_over_the_context_is_refused_before_it_is_queued(rm_engine):
    requests = rm_engine.stats["requests"]
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(PromptTooLongError, match="context is 4096 tokens"):
        rm_engine.stream(long)
    assert rm_engine.stats["requests"] == requests


def test_answers_stop_at_the_context(rm_engine):
    prompt = len(rm_engine.prompt_ids(HI))
    assert rm_engine.sampling(prompt, max_tokens=10**6).max_new_tokens == rm_engine.context - prompt


@pytest.mark.parametrize("options", [{"max_tokens": 0}, {"n": 0}, {"temperature": -1}, {"stop": [""]}])
def test_bad_settings_are_refused(rm_engine, options):
    with pytest.raises(RequestError):
        rm_engine.stream(HI, **options)


def test_closing_a_stream_cancels_the_generation(rm_engine):
    before = dict(rm_engine.stats)
    events = rm_engine.stream(HI, max_tokens=3000)
    assert isinstance(next(events), Delta)
    events.close()
    deadline = time.monotonic() + 30
    while rm_engine.stats["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rm_engine.stats["cancelled"] == before["cancelled"] + 1
    assert rm_engine.stats["generated_tokens"] - before["generated_tokens"] < 1000


def test_beam_search_answers_as_generate_does(rm_engine):
    gen = replace(rm_engine.gen, num_beams=2)
    with Engine(rm_engine.lm, rm_engine.tokenizer, rm_engine.template, gen, context=rm_engine.context) as beams:
        answer = beams.complete(HI, max_tokens=8).choices[0]
        ids = torch.tensor([beams.prompt_ids(HI)])
        out = rm_engine.lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=2,
                                    do_sample=False, max_new_tokens=8, eos_token_id=2, pad_token_id=2)
        assert answer.text == rm_engine.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        with pytest.raises(RequestError, match="num_beams"):
            beams.stream(HI, n=3)


def test_scores_match_the_value_head_on_each_text_alone(rm_engine):
    texts = [f"<|im_start|>user\nQuestion {i}<|im_end|>\n<|im_start|>assistant\n" + "answer " * i
             for i in range(10)]  # more than one batch, of different lengths
    scores = rm_engine.score(texts)
    tok = rm_engine.tokenizer
    with torch.no_grad():
        for text, score in zip(texts, scores, strict=True):
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            alone = rm_engine.scorer(input_ids=ids, sequence_ends=torch.tensor([ids.shape[1] - 1]))
            assert score == pytest.approx(alone.item(), abs=1e-5)
    head = tok(texts[3], add_special_tokens=False)["input_ids"][:4]
    assert rm_engine.score([texts[3]], max_length=4) == pytest.approx(rm_engine.score([tok.decode(head)]), abs=1e-5)


def test_vllm_backend_names_what_to_install(rm_model_dir):
    pytest.importorskip("pytest")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match="pip install vllm"):
        Engine.from_config(infer_cfg(rm_model_dir, infer_backend="vllm"))
