"""Token ids -> text, one token at a time, for streaming: whole characters only, and stop strings cut.

Decoding each new token on its own breaks text: a byte-level BPE token can hold half of a UTF-8
character (one emoji is often three tokens), and SentencePiece tokenizers drop or keep a leading space
depending on what comes before. `Detokenizer` decodes a short window that starts a few tokens back
and releases the new text only once it no longer ends in an incomplete character (U+FFFD), so the
joined pieces equal what the whole answer decodes to.

`Output` is one answer as it grows: it stops at the end-of-turn / eos token ids and at the stop
strings, never hands out the start of a stop string (it waits until the text can no longer become
one), and cuts the text before the stop string.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoding; `text` is the confirmed text, `push` returns what a token added to it."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # first token of the window decoded again (context for spacing)
        self._read = 0  # tokens whose text is in self.text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of the tokens still held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""  # no new text yet (a special token skipped, or half a character)
        new = after[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return new


def held_back(text: str, stops: Iterable[str]) -> int:
    """How many characters at the end of text could be the start of one of the stop strings."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class Output:
    """One generated answer: feed it token ids; it returns the text that is safe to show and finishes
    itself at a stop token or stop string (finish_reason "stop"), or when told (`finish`)."""

    def __init__(
        self,
        tokenizer: Any,
        stop_token_ids: Iterable[int] = (),
        stop_strings: Iterable[str] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.emitted = 0  # characters of the text handed out so far
        self.tokens = 0  # tokens generated (a stop token included)
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """The answer so far, as handed out (the whole answer once finished)."""
        return self._detok.text[: self.emitted]

    def push(self, token_id: int) -> str:
        if self.finish_reason is not None:
            return ""
        self.tokens += 1
        if token_id in self._stop_ids:
            return self.finish("stop")
        self._detok.push(token_id)
        return self._release(final=False)

    def finish(self, reason: str) -> str:
        """End the answer (reason: stop, length, cancelled); returns the text that was held back."""
        if self.finish_reason is not None:
            return ""
        self._detok.flush()
        out = self._release(final=True)
        if self.finish_reason is None:
            self.finish_reason = reason
        return out

    def _release(self, *, final: bool) -> str:
        text = self._detok.text
        hits = [i for i in (text.find(s, self.emitted) for s in self._stops) if i >= 0]
        if hits:  # the text ends before the first stop string; the rest is dropped
            end = min(hits)
            self.finish_reason = "stop"
        else:
            end = len(text) if final else len(text) - held_back(text[self.emitted :], self._stops)
        if end <= self.emitted:
            return ""
        out = text[self.emitted : end]
        self.emitted = end
        return out
