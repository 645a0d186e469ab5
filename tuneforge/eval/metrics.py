"""Text-similarity scores of generated answers: BLEU-4 and ROUGE-1/2/L, as LlamaFactory reports them.

Each score is computed per sample and averaged over the samples, x100:
- BLEU-4: nltk's `sentence_bleu` over *characters* (the label's characters are the reference, the
  prediction's the hypothesis), equal n-gram weights, smoothing method3, as LlamaFactory computes it.
- ROUGE-1/2/L: the F-measure of `rouge-score`'s scorer (no stemming). rouge-score's own tokenizer keeps
  only ASCII letters and digits, so non-Latin text would vanish; `text_tokens` below is used instead: it
  lowercases and splits on everything that is not a letter, mark or digit (for ASCII text these are exactly
  rouge-score's tokens), and makes each character of a script written without spaces (Chinese, Japanese,
  Korean, Thai) a token of its own. LlamaFactory segments Chinese into words with jieba; per-character
  tokens need no extra package and score Chinese text on the same scale as BLEU's characters.

nltk needs no downloaded data for `sentence_bleu`, and rouge-score none for its scorer.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from tuneforge.errors import ConfigError

INSTALL_HINT = "pip install 'tuneforge[eval]'"
METRIC_NAMES = ("bleu-4", "rouge-1", "rouge-2", "rouge-l")
ROUGE_TYPES = {"rouge-1": "rouge1", "rouge-2": "rouge2", "rouge-l": "rougeL"}

# scripts written without spaces between words: one token per character
_PER_CHARACTER = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1100, 0x11FF),  # Hangul Jamo
    (0x2E80, 0x2FDF),  # CJK radicals
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3100, 0x31FF),  # Bopomofo, Hangul compatibility Jamo, Katakana extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # Hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0x20000, 0x3FFFF),  # CJK extensions B and later
)


def require() -> None:
    """Stop (before any model loads) when nltk or rouge-score is missing."""
    try:
        import nltk.translate.bleu_score  # noqa: F401
        import rouge_score.rouge_scorer  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"predict_with_generate scores the answers with nltk (BLEU) and rouge-score (ROUGE), but "
            f"{e.name or 'one of them'} is not installed: {INSTALL_HINT}"
        ) from None


def _per_character(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _PER_CHARACTER)


def text_tokens(text: str) -> list[str]:
    """Lowercased words of letters / marks / digits; each character of a CJK or Thai script alone."""
    tokens: list[str] = []
    word: list[str] = []
    for ch in text.lower():
        if _per_character(ch):
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(ch)
        elif unicodedata.category(ch)[0] in "LMN":
            word.append(ch)
        elif word:
            tokens.append("".join(word))
            word = []
    if word:
        tokens.append("".join(word))
    return tokens


class _Tokenizer:
    """What rouge-score's scorer calls: an object with tokenize(text)."""

    def tokenize(self, text: str) -> list[str]:
        return text_tokens(text)


def bleu4(prediction: str, label: str) -> float:
    """Sentence BLEU-4 (0-1) over characters with smoothing method3."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    if not prediction or not label:
        return 0.0
    return float(sentence_bleu([list(label)], list(prediction), smoothing_function=SmoothingFunction().method3))


def rouge(prediction: str, label: str, scorer=None) -> dict[str, float]:
    """ROUGE-1/2/L F-measures (0-1) of one prediction against its label."""
    if scorer is None:
        scorer = rouge_scorer()
    if not text_tokens(prediction) or not text_tokens(label):
        return {name: 0.0 for name in ROUGE_TYPES}
    scores = scorer.score(label, prediction)  # rouge-score takes (target, prediction)
    return {name: float(scores[kind].fmeasure) for name, kind in ROUGE_TYPES.items()}


def rouge_scorer():
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(list(ROUGE_TYPES.values()), use_stemmer=False, tokenizer=_Tokenizer())


def similarity(predictions: Sequence[str], labels: Sequence[str]) -> dict[str, float]:
    """Mean BLEU-4 and ROUGE-1/2/L over the samples, x100 (LlamaFactory's predict_* figures)."""
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    if not predictions:
        return {name: 0.0 for name in METRIC_NAMES}
    scorer = rouge_scorer()
    totals = dict.fromkeys(METRIC_NAMES, 0.0)
    for prediction, label in zip(predictions, labels, strict=True):
        totals["bleu-4"] += bleu4(prediction, label)
        for name, value in rouge(prediction, label, scorer).items():
            totals[name] += value
    return {name: 100.0 * total / len(predictions) for name, total in totals.items()}
