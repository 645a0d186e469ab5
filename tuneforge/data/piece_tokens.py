"""SentencePiece-style BPE a word at a time: word_tokens' memory of words for Llama 2, Mistral v0.x and Gemma.

These pipelines write each space as "▁" (a Metaspace pre-tokenizer, or a Replace normalizer), may put a "▁" before a
stretch between added tokens, and run the BPE model (with byte fallback) over the whole stretch: no regex splits it
into words. It splits here before every "▁" that follows another character, which gives the same tokens as long as
no token of the vocabulary holds a "▁" after another character (checked when the tokenizer is read: SentencePiece
makes none when it splits its training text at whitespace, its default). Each piece's tokens are then remembered as
word_tokens remembers a word's, and the characters are probed against the tokenizer as there. Checked against
Mistral's own tokenizers (v1 and v3, in five pipelines) on LlamaFactory's demo rows: the same ids and offsets.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from itertools import accumulate, pairwise
from typing import Any

from tuneforge.data.word_tokens import WordTokens, _plain_added, _plain_bpe, _spec, _untrimmed, in_characters

SPACE = "▁"
REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
PREPEND = {"type": "Prepend", "prepend": SPACE}
# Gemma's tokenizer.json splits at spaces after its normalizer has written them all as ▁: it splits nothing
SPLIT_AT_SPACES = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}

# pieces of a stretch whose spaces are written as ▁: before every ▁ that follows another character (the BPE model
# sees the whole stretch), or before every ▁ (a Metaspace that splits); and around each newline where no token
# holds one (Llama 2's and Mistral's vocabularies write it as a byte)
PIECES = {(False, False): f"{SPACE}*[^{SPACE}]+|{SPACE}+", (True, False): f"{SPACE}?[^{SPACE}]+|{SPACE}",
          (False, True): f"\n|{SPACE}*[^{SPACE}\n]+|{SPACE}+", (True, True): f"\n|{SPACE}?[^{SPACE}\n]+|{SPACE}"}
_SPANS_A_CUT = re.compile(f"[^{SPACE}]{SPACE}")


class PieceTokens(WordTokens):
    """Encodes texts as a SentencePiece-style pipeline's `backend.encode_batch(texts, add_special_tokens=False)`:
    ids and character offsets.

    prepend: when a ▁ goes before a stretch between added tokens: "first" (only the text's first stretch, unless it
    starts with one; Metaspace's prepend_scheme first), "always" (every stretch unless it starts with one), "every"
    (every stretch, a Prepend normalizer: Llama 2's tokenizer.json) or "never" (Gemma)."""

    def __init__(self, backend: Any, added: list[Any], prepend: str, split: bool, newlines: bool = False):
        self._prepend = prepend
        self._lifted: list[int] = []  # the words of the text being split that begin with a ▁ put there
        self._pieces = re.compile(PIECES[split, newlines])  # (the standard library's re: faster here than regex)
        super().__init__(backend, self._pieces.pattern, nfc=False, added=added)

    @classmethod
    def read(cls, backend: Any) -> PieceTokens | None:
        """PieceTokens for a tokenizers.Tokenizer whose pipeline this module reads, else None."""
        if not _plain_bpe(backend.model) or backend.model.ignore_merges:
            return None
        normalizer = _spec(backend.normalizer)
        scheme = _scheme(normalizer, _spec(backend.pre_tokenizer))
        added = list(backend.get_added_tokens_decoder().values())
        if (scheme is None or not _plain_added(added) or not _untrimmed(_spec(backend.post_processor))
                or (normalizer is not None and any(t.normalized for t in added))):
            return None
        prepend, split = scheme
        vocab = backend.get_vocab(with_added_tokens=False)
        if SPACE not in vocab or (not split and any(map(_SPANS_A_CUT.search, vocab))):
            return None
        return cls(backend, added, prepend, split, newlines=not any("\n" in token for token in vocab))

    def _split_text(self, text: str) -> tuple[list[str], Collection[int]]:
        self._lifted = []
        return self._words(text), self._lifted

    def _add_stretch(self, stretch: str, words: list[str]) -> None:
        stretch = stretch.replace(" ", SPACE)
        if self._prepend == "every" or (self._prepend != "never" and not stretch.startswith(SPACE)
                                        and (self._prepend == "always" or not words)):
            self._lifted.append(len(words))
            stretch = SPACE + stretch
        words += self._pieces.findall(stretch)

    def _tokenize(self, word: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """A piece's ids and its tokens' character offsets within it, from the tokenizer's BPE model (byte fallback
        gives each byte of a character the vocabulary lacks a token of its own); no offsets where the tokens do not
        cover the piece's bytes in order."""
        tokens = self.backend.model.tokenize(word)
        ids = [t.id for t in tokens]
        values = [t.value for t in tokens]
        if "".join(values) == word:  # no byte fallback: each token is its text
            return ids, list(pairwise(accumulate(map(len, values), initial=0)))
        spans = [t.offsets for t in tokens]  # in bytes
        ends = [end for _, end in spans]
        if [start for start, _ in spans] != [0, *ends[:-1]] or (ends[-1] if ends else 0) != len(word.encode()):
            return ids, None
        return ids, in_characters(word, ends)


def _scheme(normalizer: dict | None, pre: dict | None) -> tuple[str, bool] | None:
    """(when a ▁ goes before a stretch, whether the pipeline splits at every ▁) of a pipeline that writes spaces as
    ▁; None for another."""
    if normalizer is None and pre is not None and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE:
        prepend = pre.get("prepend_scheme", "always")
        return (prepend, bool(pre.get("split", True))) if prepend in ("first", "always", "never") else None
    if normalizer is None or (pre is not None and pre != SPLIT_AT_SPACES):
        return None
    steps = normalizer["normalizers"] if normalizer.get("type") == "Sequence" else [normalizer]
    if steps == [REPLACE]:
        return "never", False
    if steps == [PREPEND, REPLACE]:
        return "every", False
    return None
