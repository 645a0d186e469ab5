"""BLEU-4 / ROUGE of generated answers: the packages' own numbers, a hand-checked case, non-Latin text."""

import sys

import pytest
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from rouge_score.rouge_scorer import RougeScorer
from rouge_score.tokenizers import DefaultTokenizer

from tuneforge.errors import ConfigError
from tuneforge.eval import metrics

PAIRS = [  # (prediction, label)
    ("The cat sat on the mat.", "A cat was sitting on the mat."),
    ("Paris is the capital of France", "The capital of France is Paris."),
    ("I don't know", "It is 42, as everyone knows!"),
    ("hello_world foo-bar 3.5", "Hello world, foo bar 3 5"),
]


def test_ascii_tokens_are_rouge_scores_own():
    default = DefaultTokenizer(use_stemmer=False)
    for prediction, label in PAIRS:
        for text in (prediction, label):
            assert metrics.text_tokens(text) == default.tokenize(text)


def test_similarity_equals_the_packages_numbers():
    scorer = RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    expected = {"bleu-4": 0.0, "rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    for prediction, label in PAIRS:
        expected["bleu-4"] += sentence_bleu([list(label)], list(prediction),
                                            smoothing_function=SmoothingFunction().method3)
        scores = scorer.score(label, prediction)
        for name, kind in (("rouge-1", "rouge1"), ("rouge-2", "rouge2"), ("rouge-l", "rougeL")):
            expected[name] += scores[kind].fmeasure
    got = metrics.similarity([p for p, _ in PAIRS], [lab for _, lab in PAIRS])
    assert got == pytest.approx({k: 100 * v / len(PAIRS) for k, v in expected.items()}, abs=1e-9)
    assert 0 < got["rouge-2"] < got["rouge-1"] < 100


def test_hand_checked_values():
    assert metrics.similarity(["Exactly the same answer."], ["Exactly the same answer."]) == pytest.approx(
        {"bleu-4": 100.0, "rouge-1": 100.0, "rouge-2": 100.0, "rouge-l": 100.0})
    # words: prediction 3 of them, label 6; all 3 (2 bigrams, LCS 3) in the label
    scores = metrics.rouge("the cat sat", "the cat sat on the mat")
    assert scores["rouge-1"] == pytest.approx(2 * 1 * 0.5 / 1.5)  # P 3/3, R 3/6
    assert scores["rouge-2"] == pytest.approx(2 * 1 * 0.4 / 1.4)  # P 2/2, R 2/5
    assert scores["rouge-l"] == pytest.approx(2 * 1 * 0.5 / 1.5)
    # characters: 1- to 4-gram precisions 4/5, 3/4, 2/3, 1/2, equal lengths (no brevity penalty)
    assert metrics.bleu4("abcde", "abcdf") == pytest.approx((0.8 * 0.75 * (2 / 3) * 0.5) ** 0.25)
    assert metrics.similarity(["", "x"], ["an answer", ""]) == {n: 0.0 for n in metrics.METRIC_NAMES}


def test_chinese_is_scored_per_character():
    assert metrics.text_tokens("我爱北京, hello Wörld! 東京タワー") == [
        "我", "爱", "北", "京", "hello", "wörld", "東", "京", "タ", "ワ", "ー"]
    # rouge-score's own tokenizer drops every Chinese character (so it would score 0 here)
    assert DefaultTokenizer().tokenize("我爱北京") == []
    scores = metrics.rouge("我爱北京", "我爱上海")  # 2 of 4 characters, 1 of 3 bigrams
    assert scores["rouge-1"] == pytest.approx(0.5)
    assert scores["rouge-2"] == pytest.approx(1 / 3)


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rouge_score.rouge_scorer", None)
    with pytest.raises(ConfigError, match=r"pip install 'tuneforge\[eval\]'"):
        metrics.require()
