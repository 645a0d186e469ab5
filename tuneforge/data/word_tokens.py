"""Byte-level BPE with each word's tokens remembered: the tokenizer's own ids and offsets, ~3x as fast on chat data.

A fast tokenizer's call spends most of its time around the merges, not in them: it cuts the text at the added
tokens, splits the rest into words with its regex, maps each byte to a character and tracks every character's
offset; the merges of a word it has seen before come from its cache. In a chat dataset a few thousand words make up
almost all the text (14,506 distinct words among 972,470 in 2,000 rows of sharegpt_10k), so cutting and splitting
with Python's `regex` and remembering each word's tokens and offsets here takes a third of the call's time
(docs/performance.md, "Preprocessing").

The result is the tokenizer's own, by construction and by check:
- only for a tokenizer whose pipeline is byte-level BPE as GPT-2, Llama 3 and Qwen write it (no normalizer or
  NFC; a ByteLevel pre-tokenizer with its regex, or a Split by a regex before one without; a BPE model without
  dropout, byte fallback or word affixes; added tokens without strip or single-word rules; no offset trimming);
- a word's tokens come from the tokenizer's own BPE model;
- a text is taken only when each of its characters has been probed: the character, in contexts that tell the
  regex's character classes apart, tokenized here and by the tokenizer, with the same ids and offsets. Regex
  engines can disagree on a character's class (their Unicode versions differ); such a character's texts go to
  the tokenizer.
SentencePiece-style pipelines (Llama 2, Mistral v0.x, Gemma: spaces written as ▁, byte fallback) are read by
piece_tokens, which splits their text into pieces where no token can span and otherwise works as here. Every other
text, and every other tokenizer, goes to the tokenizer's own call. `TUNEFORGE_WORD_TOKENS=0` sends all.
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Sequence
from itertools import accumulate, chain, filterfalse, pairwise
from typing import Any

import regex

from tuneforge.errors import DataError
from tuneforge.flags import env_switch

# The split a ByteLevel pre-tokenizer applies when its use_regex is on (the tokenizers library's byte_level.rs).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Where a character stands in a probe: beside letters, digits, spaces, newlines, punctuation, itself, an apostrophe.
PROBE_CONTEXTS = ("{}", "a{}", "{}a", "A{}b", "1{}", "{}1", "12{}3", " {}", "{} ", "  {} ", "!{}", "{}!", "\n{}",
                  "{}\n", " {}\n", "\r\n{}", "\t{}", "{}{}", "a{}{}a", "'{}", "{}'s")

# Characters beyond the scripts that put spaces between words (Latin, Greek, Cyrillic, Armenian, Hebrew, Arabic),
# punctuation, symbols and emoji: Chinese or Thai text splits into long runs of letters that seldom recur, which the
# tokenizer's own call handles faster than a word at a time here. A text with a few of them (a name, a symbol, a
# replacement character in an English web page) stays here: at most UNSPACED_SHARE of its characters.
UNSPACED = regex.compile(r"[^\x00-\u06ff\u1e00-\u1fff\u2000-\u2bff\ufe00-\ufe0f\U0001f000-\U0001faff]")
UNSPACED_SHARE = 0.02

logger = logging.getLogger(__name__)

ENV = "TUNEFORGE_WORD_TOKENS"
MAX_WORDS = 100_000  # words remembered at most; past it the memory starts again (a text's words are kept whole)

_BYTE_CHARS = None  # byte -> the character byte-level BPE writes for it
_for_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_chars() -> list[str]:
    """GPT-2's byte-to-character map: printable bytes as themselves, the rest from U+0100 on."""
    global _BYTE_CHARS
    if _BYTE_CHARS is None:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars = {b: chr(b) for b in printable}
        for n, b in enumerate(b for b in range(256) if b not in chars):
            chars[b] = chr(256 + n)
        _BYTE_CHARS = [chars[b] for b in range(256)]
    return _BYTE_CHARS


def for_tokenizer(tokenizer: Any) -> WordTokens | None:
    """The WordTokens of a transformers fast tokenizer, or None where its pipeline is not one this module reads."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not env_switch(ENV, DataError) or getattr(backend, "encode_special_tokens", False):
        return None  # (special tokens read as text: the tokenizer's own rule)
    size = backend.get_vocab_size(with_added_tokens=True)
    try:
        kept = _for_tokenizer.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return None
    if kept is None or kept[0] != size:  # tokens added since: read the pipeline again
        from tuneforge.data.piece_tokens import PieceTokens

        kept = (size, WordTokens.read(backend) or PieceTokens.read(backend))
        _for_tokenizer[tokenizer] = kept
        if kept[1] is not None:
            logger.info("tokenizing a word at a time, each word's tokens remembered: the tokenizer's own ids and "
                        "offsets, faster (%s=0 leaves it all to the tokenizer's call)", ENV)
    return kept[1]


def encode_documents(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=True)["input_ids"]` (the pt encoder's documents): the texts WordTokens takes
    come from there, with the special tokens the tokenizer puts before and after every text."""
    words = for_tokenizer(tokenizer)
    affixes = None if words is None else _special_affixes(tokenizer)
    ids: list = [None] * len(texts) if affixes is None else words.encode(texts, with_offsets=False)[0]
    prefix, suffix = affixes or ([], [])
    rest = [n for n, got in enumerate(ids) if got is None]
    for n, got in enumerate(ids):
        if got is not None and (prefix or suffix):
            ids[n] = prefix + got + suffix
    if rest:
        for n, got in zip(rest, tokenizer([texts[n] for n in rest], add_special_tokens=True)["input_ids"], strict=True):
            ids[n] = got
    return ids


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """The special tokens the tokenizer adds before and after a text, read off two probes; None where they are not
    the same for both (a post-processor that is not a fixed template)."""
    found = set()
    for probe in ("a", "Hello there, 12 words"):
        full = tokenizer(probe, add_special_tokens=True)["input_ids"]
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        if at is None:
            return None
        found.add((tuple(full[:at]), tuple(full[at + len(plain):])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)


class WordTokens:
    """Encodes texts as `backend.encode_batch(texts, add_special_tokens=False)` does: ids and character offsets.

    One per tokenizer and process (for_tokenizer), used from one thread at a time: the encoders' (its memory of
    words is not guarded against another thread forgetting it in between)."""

    def __init__(self, backend: Any, split: str, nfc: bool, added: list[Any]):
        self.backend, self.nfc = backend, nfc
        self._split = regex.compile(split)
        self._ascii_split = _for_ascii(split) or self._split
        self._added_ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        # the tokenizers library cuts at tokens matched on the raw text first, then at those matched on the
        # normalized text; each pass takes the leftmost match, the longest there (alternatives longest first)
        self._cuts = [cut for cut in (_alternation([t.content for t in added if t.normalized is normalized])
                                      for normalized in (False, True)) if cut is not None]
        self._ids: dict[str, list[int]]  # a word's tokens
        self._lengths: dict[str, list[int] | None]  # their lengths in characters, where they tile the word
        self._offsets: dict[str, list[tuple[int, int]] | None]  # their offsets in the word, where they do not
        self._forget()
        self._checked: dict[str, bool] = {}  # character -> whether its probes come out as the tokenizer's
        self._separator = min((t.content for t in added if not t.normalized), key=len, default="")
        self._check(set(map(chr, range(128))))
        # control characters a vocabulary lacks
        self._ascii_failed = [c for c in map(chr, range(128)) if not self._checked[c]]

    @classmethod
    def read(cls, backend: Any) -> WordTokens | None:
        """WordTokens for a tokenizers.Tokenizer whose pipeline this module reads, else None."""
        split = _split_pattern(_spec(backend.pre_tokenizer))
        normalizer = _spec(backend.normalizer)
        model = backend.model
        added = list(backend.get_added_tokens_decoder().values())
        if (split is None or not _plain_bpe(model) or model.byte_fallback or not _plain_added(added)
                or not _untrimmed(_spec(backend.post_processor)) or normalizer not in (None, {"type": "NFC"})):
            return None
        return cls(backend, split, nfc=normalizer is not None, added=added)

    def encode(self, texts: list[str], with_offsets: bool = True
               ) -> tuple[list[list[int] | None], list[Sequence[tuple[int, int]] | None]]:
        """Ids and offsets (None without with_offsets) of each text; None for a text this module leaves to the
        tokenizer."""
        # the texts in scripts with spaces between words, searched once; their new characters are probed first
        spaced = [text.isascii() or len(UNSPACED.findall(text)) <= UNSPACED_SHARE * len(text) for text in texts]
        met = set().union(*(text for text, ok in zip(texts, spaced, strict=True) if ok and not text.isascii()))
        self._check(set(filterfalse(self._checked.__contains__, met)))
        all_ids: list = [None] * len(texts)
        all_offsets: list = [None] * len(texts)
        for n, text in enumerate(texts):
            encoded = self._encode(text, with_offsets) if spaced[n] and self._takes(text) else None
            if encoded is not None:
                all_ids[n], all_offsets[n] = encoded
        return all_ids, all_offsets

    def _takes(self, text: str) -> bool:
        """Whether every character of a text in a spaced script has passed its probes (and NFC leaves it as it is)."""
        if text.isascii():
            return not any(map(text.__contains__, self._ascii_failed))  # a substring search each: 25x a regex's
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return False
        return all(map(self._checked.__getitem__, set(text)))

    def _check(self, chars: set[str]) -> None:
        """Probe the characters: in every context, this module's ids and offsets against the tokenizer's.

        Many characters' probes go in one text, an added token between two (each stretch between added tokens is
        split and merged on its own); where that text differs, each half of the characters is probed again."""
        if not chars:
            return
        contexts = self._contexts(chars)
        if len(chars) == 1 or self._separator:
            ordered = sorted(chars)
            probes = (self._separator.join(context.format(c, c) for c in ordered) for context in contexts)
            if all(map(self._same_as_backend, probes)):
                self._checked.update(dict.fromkeys(chars, True))
                return
            if len(chars) == 1:
                self._checked[ordered[0]] = False
                return
            self._check(set(ordered[:len(ordered) // 2]))
            self._check(set(ordered[len(ordered) // 2:]))
            return
        for c in chars:  # no added token to put between probes
            self._check({c})

    def _contexts(self, chars: set[str]) -> list[str]:
        """The probe contexts; under NFC, those that leave every probe as it is (other texts go to the tokenizer)."""
        if not self.nfc:
            return list(PROBE_CONTEXTS)
        return [context for context in PROBE_CONTEXTS
                if all(unicodedata.is_normalized("NFC", context.format(c, c)) for c in chars)]

    def _same_as_backend(self, probe: str) -> bool:
        expected = self.backend.encode(probe, add_special_tokens=False)
        return self._encode(probe) == (expected.ids, expected.offsets)

    def _encode(self, text: str, with_offsets: bool = True
                ) -> tuple[list[int], Sequence[tuple[int, int]] | None] | None:
        words, lifted = self._split_text(text)
        word_ids = list(map(self._ids.get, words))
        if None in word_ids:
            self._learn(words)
            word_ids = list(map(self._ids.__getitem__, words))
        ids = list(chain.from_iterable(word_ids))
        if not with_offsets:
            return ids, None
        lengths = list(map(self._lengths.__getitem__, words))
        if lifted or None in lengths:
            offsets = self._offsets_of(words, lifted)
            return None if offsets is None else (ids, offsets)
        return ids, Tiled(list(accumulate(chain.from_iterable(lengths), initial=0)))

    def _split_text(self, text: str) -> tuple[list[str], Collection[int]]:
        """The text's words, and which of them begin with a character the pipeline put there (none here: the words
        tile the text)."""
        return self._words(text), ()

    def _words(self, text: str, phase: int = 0, words: list[str] | None = None) -> list[str]:
        """The text cut at the added tokens, and each stretch between them split into words: pieces that tile the
        text, each tokenized alone."""
        words = [] if words is None else words
        if phase == len(self._cuts):
            self._add_stretch(text, words)
            return words
        for n, part in enumerate(self._cuts[phase].split(text)):  # stretch, token, stretch, ..., stretch
            if n % 2:
                words.append(part)
            elif part:
                self._words(part, phase + 1, words)
        return words

    def _add_stretch(self, stretch: str, words: list[str]) -> None:
        """Append the words of a stretch between added tokens (`words`: those of the text before it)."""
        words += self._words_in(stretch)

    def _words_in(self, stretch: str) -> list[str]:
        """The regex's matches in a stretch between added tokens, and the text between them (the tokenizers
        library's "Isolated" split)."""
        split = self._ascii_split if stretch.isascii() else self._split
        words = split.findall(stretch)
        if sum(map(len, words)) == len(stretch):
            return words
        words, start = [], 0
        for m in split.finditer(stretch):
            if m.start() > start:
                words.append(stretch[start:m.start()])
            words.append(m.group())
            start = m.end()
        if len(stretch) > start:
            words.append(stretch[start:])
        return words

    def _learn(self, words: list[str]) -> None:
        """Remember the tokens of the words not yet met, from the tokenizer's own BPE model."""
        new = set(filterfalse(self._ids.__contains__, words))
        if not new:
            return
        if len(self._ids) + len(new) > MAX_WORDS:  # start again rather than grow without bound
            self._forget()
            new = set(filterfalse(self._ids.__contains__, words))  # this text's words, all of them
        for word in new:
            ids, offsets = self._tokenize(word)
            self._ids[word] = ids
            ends = [0, *(end for _, end in offsets or ())]
            if offsets is not None and [start for start, _ in offsets] == ends[:-1] and ends[-1] == len(word):
                self._lengths[word] = [end - start for start, end in offsets]
            else:  # a token ends inside a character, or the model dropped a byte
                self._lengths[word] = None
                self._offsets[word] = offsets

    def _forget(self) -> None:
        """Remember no word but the added tokens (each its own piece of a text)."""
        self._ids = {content: [i] for content, i in self._added_ids.items()}
        self._lengths = {content: [len(content)] for content in self._added_ids}
        self._offsets = {}

    def _tokenize(self, word: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """A word's ids and its tokens' character offsets within it, from the tokenizer's BPE model; no offsets where
        the model drops a byte its vocabulary lacks (the tokenizer's own call places the rest)."""
        data = word.encode()
        chars = byte_chars()
        byte_level = "".join(chars[b] for b in data)  # one character per byte of the word
        tokens = self.backend.model.tokenize(byte_level)
        ids = [t.id for t in tokens]
        values = [t.value for t in tokens]
        if "".join(values) != byte_level:
            return ids, None
        return ids, in_characters(word, list(accumulate(map(len, values))))

    def _offsets_of(self, words: list[str], lifted: Collection[int] = ()) -> list[tuple[int, int]] | None:
        """Offsets word by word, for a text whose tokens do not tile it; None where a word has none.

        lifted: the words whose first character the pipeline put there (a SentencePiece-style pipeline's ▁ before
        a stretch), which the tokenizers library aligns with the character after it."""
        offsets: list[tuple[int, int]] = []
        start = 0
        for n, word in enumerate(words):
            lengths = self._lengths[word]
            if lengths is None and self._offsets[word] is None:
                return None
            if n in lifted:
                within = self._offsets[word] if lengths is None else pairwise(accumulate(lengths, initial=0))
                offsets += [(start + max(a - 1, 0), start + max(b - 1, 1)) for a, b in within]
                start -= 1
            elif lengths is None:
                offsets += [(start + a, start + b) for a, b in self._offsets[word]]
            else:
                offsets += pairwise(accumulate(lengths, initial=start))
            start += len(word)
        return offsets


def in_characters(word: str, byte_ends: list[int]) -> list[tuple[int, int]]:
    """The character offsets of tokens that tile a word's UTF-8 bytes, each ending at byte_ends[i]."""
    if word.isascii():
        return list(pairwise([0, *byte_ends]))
    # a byte's offsets are those of its character: a token starts at the character its first byte is in and ends
    # after the one its last byte is in
    char_ends = list(accumulate(map(len, map(str.encode, word))))  # in bytes
    return [(bisect_right(char_ends, a), bisect_left(char_ends, b) + 1) for a, b in pairwise([0, *byte_ends])]


class Tiled(Sequence):
    """The character offsets of tokens that tile a text, kept as their starts: token i spans starts[i] to
    starts[i + 1]. A text's hundreds of offset pairs are never built; token_spans bisects the starts."""

    __slots__ = ("starts",)

    def __init__(self, starts: list[int]):
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.starts[i], self.starts[i + 1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == [tuple(pair) for pair in other]

    def token_spans(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """template.token_spans: [first, last) indices of the tokens that overlap each character span."""
        starts, n = self.starts, len(self.starts) - 1
        out = []
        for a, b in spans:
            first = bisect_right(starts, a, 1, n + 1) - 1  # how many end at or before a (token i ends at starts[i + 1])
            last = bisect_left(starts, b, first, n)  # the first that starts at or after b
            out.append((first, max(first, last)))
        return out


def _alternation(tokens: list[str]) -> re.Pattern | None:
    """The tokens as one pattern whose split keeps them (a group), matching the longest token at the leftmost place.

    Written as a trie (tokens that share a start share its pattern): a plain alternation tries every token at every
    character, 8x as slow for Mistral's 771 added tokens (Llama 3 has 256)."""
    if not tokens:
        return None
    trie: dict = {}
    for token in tokens:
        node = trie
        for c in token:
            node = node.setdefault(c, {})
        node[""] = {}  # a token ends here

    def pattern(node: dict) -> str:
        run = ""
        while len(node) == 1 and "" not in node:  # one way on and no token ends here (a long token: no recursion)
            (c, node), = node.items()
            run += re.escape(c)
        longer = [re.escape(c) + pattern(child) for c, child in node.items() if c]
        if not longer:
            return run
        body = longer[0] if len(longer) == 1 else "(?:" + "|".join(longer) + ")"
        return run + (f"(?:{body})?" if "" in node else body)  # greedy: the longest token that ends here wins

    return re.compile("(" + pattern(trie) + ")")


def _for_ascii(pattern: str) -> re.Pattern | None:
    """The split for ASCII text in the standard library's re, twice as fast as regex there: \\p{L} and \\p{N} are the
    ASCII letters and digits. None for a pattern with other Unicode classes. (The characters' probes check it.)"""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith(("\\p{", "\\P{"), i):
            name = pattern[i + 3:pattern.find("}", i)]
            if pattern[i + 1] == "P" or name not in _ASCII_CLASSES:
                return None
            out.append(_ASCII_CLASSES[name] if in_class else f"[{_ASCII_CLASSES[name]}]")
            i += 4 + len(name)
            continue
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            for lead in ("^", "]"):  # a "]" first in a class is a character
                if pattern.startswith(lead, i):
                    out.append(lead)
                    i += 1
            continue
        in_class = in_class and c != "]"
        out.append(c)
        i += 1
    try:
        return re.compile("".join(out), re.ASCII)
    except re.error:
        return None


_ASCII_CLASSES = {"L": "A-Za-z", "N": "0-9"}


def _plain_bpe(model: Any) -> bool:
    """Whether a tokenizer's model is BPE without dropout or word affixes: its merges alone decide a word's tokens."""
    return (type(model).__name__ == "BPE" and model.dropout is None and not model.continuing_subword_prefix
            and not model.end_of_word_suffix)


def _plain_added(added: list[Any]) -> bool:
    """Whether added tokens are matched as written: none empty, none with strip or single-word rules."""
    return all(t.content and not (t.single_word or t.lstrip or t.rstrip) for t in added)


def _spec(component: Any) -> dict | None:
    """A pipeline component's settings, as tokenizer.json writes them (without reading the whole vocabulary)."""
    return None if component is None else json.loads(component.__getstate__())


def _split_pattern(pre: dict | None) -> str | None:
    """The regex that splits words before byte-level BPE, from the pre-tokenizer's spec; None for another kind."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        return GPT2_SPLIT if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return None
    split, level = pre["pretokenizers"]
    if (level.get("type") != "ByteLevel" or level.get("use_regex", True) or level.get("add_prefix_space")
            or split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or "Regex" not in split.get("pattern", {})):
        return None
    return split["pattern"]["Regex"]


def _untrimmed(post: dict | None) -> bool:
    """Whether the post-processor leaves offsets as they are (and adds nothing without special tokens)."""
    if post is None or post.get("type") == "TemplateProcessing":
        return True
    if post.get("type") == "ByteLevel":
        return not post.get("trim_offsets", True)
    if post.get("type") == "Sequence":
        return all(_untrimmed(p) for p in post.get("processors", []))
    return False
