"""The encoder registry: a stage's row (tuneforge/stages.py) names its encoder, and the data package finds it here.

An Encoder is a batched `datasets.map` function (raw rows -> token rows with `_status`, see encode.py) plus
what the pipeline needs to know about it: its column types, whether it renders with a chat template, whether
its rows are documents that are later cut into cutoff_len rows (pretrain), whether an alpaca row must have a
response column, whether its output depends on the map's batching (kto's KL pairs are drawn within a batch),
the column prefixes of the sequences of one row, and how one encoded row reads in `tuneforge data preview`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuneforge.data import encode, encode_pref, encode_prompt
from tuneforge.data.encode_pref import SEQUENCE_PREFIXES

# how one encoded row shows in a preview: (marked(prefix, i) -> text, the encoded batch, i) -> text
Show = Callable[[Callable[[str, int], str], dict[str, list], int], str]


def _show_plain(marked: Callable[[str, int], str], enc: dict[str, list], i: int) -> str:
    return marked("", i)


def _show_pairwise(marked: Callable[[str, int], str], enc: dict[str, list], i: int) -> str:
    return f"[chosen]\n{marked('chosen_', i)}\n[rejected]\n{marked('rejected_', i)}"


KTO_TAGS = {1: "[kto_tag: true (desirable)]", 0: "[kto_tag: false (undesirable)]"}


def _show_prompt(marked: Callable[[str, int], str], enc: dict[str, list], i: int) -> str:
    return f"{marked('', i)}\n[columns for the rewards: {enc[encode_prompt.COLUMNS][i]}]"


def _show_feedback(marked: Callable[[str, int], str], enc: dict[str, list], i: int) -> str:
    return f"{KTO_TAGS[enc['kto_tag'][i]]}\n{marked('', i)}"


@dataclass(frozen=True)
class Encoder:
    name: str
    function: Callable[..., dict[str, list]]
    features: Callable[[], Any]
    chat: bool = True  # renders conversations with the chat template (the pipeline resolves one)
    documents: bool = False  # rows are documents, cut into cutoff_len rows afterwards (packing.chunk_documents)
    needs_response: bool = False  # an alpaca dataset must name a response column
    batch_dependent: bool = False  # the output depends on the map's batches: batching joins the cache key
    sequences: tuple[str, ...] = ("",)  # column prefixes of the sequences of one row, in collated order
    samples_completions: bool = False  # rows are prompts; max_completion_length tokens stay free in cutoff_len
    media: bool = False  # renders images / videos / audio through a processor (function takes processor=, media_settings=)
    show: Show = _show_plain


ENCODERS: dict[str, Encoder] = {}


def register_encoder(encoder: Encoder, *, replace: bool = False) -> Encoder:
    """Add an encoder by name (a stage row then names it); replace=True to redefine one."""
    if encoder.name in ENCODERS and not replace:
        raise ValueError(f"encoder {encoder.name!r} is already registered")
    ENCODERS[encoder.name] = encoder
    return encoder


def get_encoder(name: str) -> Encoder:
    try:
        return ENCODERS[name]
    except KeyError:
        raise KeyError(f"no data encoder named {name!r}; registered: {', '.join(ENCODERS)}") from None


register_encoder(Encoder("pretrain", encode.encode_pretrain, encode.pretrain_features, chat=False, documents=True))
register_encoder(Encoder("supervised", encode.encode_supervised, encode.supervised_features, needs_response=True,
                         media=True))
register_encoder(Encoder("pairwise", encode_pref.encode_pairwise, encode_pref.pairwise_features,
                         sequences=SEQUENCE_PREFIXES["pairwise"], show=_show_pairwise, media=True))
register_encoder(Encoder("feedback", encode_pref.encode_feedback, encode_pref.feedback_features,
                         batch_dependent=True, sequences=SEQUENCE_PREFIXES["feedback"], show=_show_feedback,
                         media=True))
register_encoder(Encoder("prompt", encode_prompt.encode_prompts, encode_prompt.prompt_features,
                         samples_completions=True, show=_show_prompt, media=True))
