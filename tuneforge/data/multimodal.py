"""Conversations with images (videos, audio) -> tokens, through the model's own processor.

The processor's chat template renders the conversation with one placeholder per medium (Qwen2-VL's
<|image_pad|>, LLaVA's <image>, ...); the processor then decides how many tokens each medium becomes and returns
the expanded ids with the tensors the model reads (pixel_values, image_grid_thw, ...). tuneforge keeps no
per-family rule: the supervised spans are found in the rendered text as for text models (template.render), moved
past each expansion with the processor's own replacement offsets, and mapped to tokens with the offset mapping.

A sample row stores its ids and labels as text rows do, plus one `mm_inputs` value: the processor's tensors for
that sample (safetensors bytes), including the per-token ones (mm_token_type_ids, token_type_ids) cut like the
ids. The collator joins them (`collate_media`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from tuneforge.batch import MEDIA_COLUMN as MEDIA_COLUMN  # re-exported: the data modules read it here
from tuneforge.data import media, template
from tuneforge.data.formats import BadRow, Conversation
from tuneforge.errors import DataError

TOKEN_PREFIX = "token:"  # a per-token tensor (shaped like input_ids) in the stored inputs
SKIPPED_KEYS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")


def message_parts(text: str, marks: dict[str, str]) -> list[dict[str, str]]:
    """A message's text -> content parts: {"type": "image"} where a placeholder stands, text in between."""
    pattern = "|".join(f"({re.escape(marks[kind])})" for kind in media.KINDS)
    parts, last = [], 0
    for match in re.finditer(pattern, text):
        if match.start() > last:
            parts.append({"type": "text", "text": text[last:match.start()]})
        parts.append({"type": media.KINDS[match.lastindex - 1]})
        last = match.end()
    if last < len(text) or not parts:
        parts.append({"type": "text", "text": text[last:]})
    return parts


def place_media(conv: Conversation, marks: dict[str, str]) -> None:
    """Check that each medium of the row has its placeholder in the messages, in order, and that no placeholder is
    left over. A row that lists media but marks none of that kind (e.g. a question column beside an image column)
    gets them at the start of its first user message, as the model cards' examples put them."""
    texts = [m["content"] for m in conv.messages] + ([conv.system] if conv.system else [])
    for kind in media.KINDS:
        found = sum(text.count(marks[kind]) for text in texts)
        given = len(conv.media.get(kind, []))
        if found == 0 and given:
            first = next(m for m in conv.messages if m["role"] == "user")
            first["content"] = marks[kind] * given + first["content"]
        elif found != given:
            raise BadRow(f"the messages hold {found} {marks[kind]} placeholder(s) but the row's "
                         f"{media.COLUMN_OF[kind]} column lists {given} file(s); give one {marks[kind]} per file, "
                         f"where it belongs in the text")


def video_sound(conv: Conversation, marks: dict[str, str]) -> Conversation:
    """use_audio_in_video: the conversation with each video paired with its sound, which the processor interleaves
    with the video's frames. In LlamaFactory's layout the sound is the row's audios, one per video
    (`<video><audio>`): their placeholders are dropped, the video's span holds them. A row with videos and no
    audios hears each video's own audio track."""
    videos, audios = conv.media.get("video", []), conv.media.get("audio", [])
    if not videos:
        return conv
    if audios and len(audios) != len(videos):
        raise BadRow(f"with use_audio_in_video each video is heard with one audio of the row: it lists "
                     f"{len(videos)} video(s) and {len(audios)} audio(s); give one audio per video, or none (each "
                     f"video's own audio track is then heard)")
    mark = marks["audio"]
    found = sum(m["content"].count(mark) for m in conv.messages) + (conv.system or "").count(mark)
    if found not in (0, len(audios)):
        raise BadRow(f"the messages hold {found} {mark} placeholder(s) but the row's audios column lists "
                     f"{len(audios)} file(s) (with use_audio_in_video, each is its video's sound)")
    messages = [dict(m, content=m["content"].replace(mark, "")) for m in conv.messages]
    sound = list(audios) or [{"track": video} for video in videos]
    return replace(conv, system=conv.system.replace(mark, "") if conv.system else conv.system, messages=messages,
                   media={**conv.media, "audio": [], media.SOUND: sound})


def chat_messages(conv: Conversation) -> list[dict[str, Any]]:
    """The messages as a processor's chat template takes them: every content a list of parts, a medium's part
    also under its kind's key ({"type": "audio", "audio": ...}), which some templates test for instead of the type.
    The key holds the row's reference (its path), or a name for an embedded medium: templates only render it."""
    marks = media.placeholders()
    refs = {kind: iter(conv.media.get(kind, [])) for kind in media.KINDS}
    out = []
    for m in conv.chat_messages():
        parts = message_parts(m["content"], marks)
        for part in parts:
            if part["type"] in refs:
                ref = next(refs[part["type"]], None)
                part[part["type"]] = ref if isinstance(ref, str) else f"{part['type']} input"
        out.append({**m, "content": parts})
    return out


@dataclass
class MediaSample:
    """One rendered sample: expanded ids, the assistant spans and the media spans as [first, last) token indices,
    and the processor's tensors (per-token ones under TOKEN_PREFIX)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    media_spans: list[tuple[int, int]]
    tensors: dict[str, Any] = field(default_factory=dict)


def _per_token(value: Any, width: int) -> bool:
    """Whether a processor output is a per-token tensor of one sample (mm_token_type_ids, token_type_ids): shaped
    (1, width) like its input_ids, and integer."""
    return value.dim() == 2 and tuple(value.shape) == (1, width) and not value.is_floating_point()


def _shift(position: int, replacements: list[dict[str, Any]]) -> int:
    """A character position of the rendered text -> the same position in the expanded text."""
    moved = position
    for r in replacements:
        (start, end), (new_start, new_end) = r["span"], r["new_span"]
        if end <= position:
            moved += (new_end - new_start) - (end - start)
    return moved


def process(processor: Any, text: str, loaded: dict[str, list[Any]], settings: media.MediaSettings) -> Any:
    """The processor on one rendered text and its media: expanded ids, offsets, replacements and tensors."""
    kwargs: dict[str, Any] = settings.processor_kwargs() if loaded.get("image") else {}
    if loaded.get("image"):
        kwargs["images"] = loaded["image"]
    if loaded.get("video"):  # (frames, metadata) pairs, already sampled (media.load_video)
        kwargs.update(videos=[frames for frames, _ in loaded["video"]],
                      video_metadata=[metadata for _, metadata in loaded["video"]], do_sample_frames=False)
    if loaded.get("audio"):
        kwargs.update(audio=loaded["audio"], sampling_rate=settings.audio_sampling_rate)
    if loaded.get(media.SOUND):  # each video's sound after the standalone clips, mapped to its video
        alone = loaded.get("audio", [])
        kwargs.update(audio=[*alone, *loaded[media.SOUND]], sampling_rate=settings.audio_sampling_rate,
                      load_audio_from_video=True,
                      audio_from_video_indices=[None] * len(alone) + list(range(len(loaded[media.SOUND]))))
    try:
        return processor(text=[text], add_special_tokens=False, return_tensors="pt", return_offsets_mapping=True,
                         return_text_replacement_offsets=True, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        raise BadRow(f"the processor cannot read this sample's media: {e}") from None


def render_sample(processor: Any, chat: template.ChatTemplate, conv: Conversation,
                  settings: media.MediaSettings) -> MediaSample:
    """Render, expand and tokenize one conversation with its media (BadRow for a broken row or file)."""
    if settings.use_audio_in_video:
        conv = video_sound(conv, media.placeholders())
    place_media(conv, media.placeholders())
    text, char_spans = template.render(processor, chat, conv, messages=chat_messages(conv))
    out = process(processor, text, media.load_media(conv.media, settings, processor), settings)
    if "text_replacement_offsets" not in out:
        raise DataError(f"{type(processor).__name__} does not report where it expands media tokens "
                        f"(return_text_replacement_offsets); tuneforge needs transformers >= 5.25 for this model")
    replacements = out["text_replacement_offsets"][0]
    offsets = [tuple(pair) for pair in out["offset_mapping"][0].tolist()]
    spans = template.token_spans(offsets, [(_shift(a, replacements), _shift(b, replacements)) for a, b in char_spans])
    media_spans = template.token_spans(offsets, [tuple(r["new_span"]) for r in replacements])
    ids = out["input_ids"][0].tolist()
    return MediaSample(ids, spans, media_spans, stored_tensors(out, len(ids)))


def stored_tensors(out: Any, width: int) -> dict[str, Any]:
    """The processor's tensors of one sample as rows store them: per-token ones (1, width) as (width,) under
    TOKEN_PREFIX, the others as they are."""
    tensors = {}
    for key, value in out.items():
        if key in SKIPPED_KEYS or not hasattr(value, "shape"):
            continue
        per_token = _per_token(value, width)
        tensors[TOKEN_PREFIX + key if per_token else key] = value[0] if per_token else value
    return tensors


def generate_inputs(blob: bytes | None) -> dict[str, Any]:
    """A stored sample's tensors (mm_inputs) as the model takes them for one row (prompt_inputs gives them so for
    generate): per-token ones (1, n)."""
    return {(k[len(TOKEN_PREFIX):] if k.startswith(TOKEN_PREFIX) else k): (v[None] if k.startswith(TOKEN_PREFIX) else v)
            for k, v in unpack_tensors(blob).items()}


def prompt_inputs(processor: Any, conv: Conversation, settings: media.MediaSettings,
                  tools: list[dict[str, Any]] | str | None = None, chat: template.ChatTemplate | None = None,
                  ) -> tuple[list[int], dict[str, Any]]:
    """A conversation up to the assistant's next turn (generation prompt included) with its media: the token ids
    and the processor's tensors for model.generate (chat, api). chat: the run's chat template (its options, the
    variables the processor's template reads, and its tool_format, as training renders). BadRow for a broken file
    or placeholder count."""
    if settings.use_audio_in_video:
        conv = video_sound(conv, media.placeholders())
    place_media(conv, media.placeholders())
    messages, tools = chat_messages(conv), template.parse_tools(tools) if isinstance(tools, str) else tools
    if chat is not None:
        messages, tools = template.with_tool_format(chat, messages, tools or None)
    try:
        text = processor.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **(chat.kwargs if chat is not None else {}))
    except Exception as e:  # templates raise for conversations they refuse
        raise BadRow(f"the chat template cannot render this conversation: {e}") from None
    out = process(processor, text, media.load_media(conv.media, settings, processor), settings)
    tensors = {k: v for k, v in out.items() if k not in SKIPPED_KEYS and hasattr(v, "shape")}
    return out["input_ids"][0].tolist(), tensors


def repeat_inputs(tensors: dict[str, Any], copies: int, width: int) -> dict[str, Any]:
    """A prompt's media inputs for `copies` rows of one generate batch: per-token tensors (1, width) repeated as rows,
    the others joined `copies` times, as the processor batches copies of one sample."""
    out = {}
    for key, value in tensors.items():
        out[key] = value.repeat(copies, 1) if _per_token(value, width) else _join([value] * copies)
    return out


def left_padded_media(samples: list[dict[str, Any]], lengths: list[int], width: int) -> dict[str, Any]:
    """Prompts' media inputs (prompt_inputs) for one left-padded generate batch: per-token tensors padded on the
    left with 0 to the batch's width, the others joined in row order."""
    import torch

    out: dict[str, Any] = {}
    for key in sorted({k for s in samples for k in s}):
        values = [s[key] for s in samples if key in s]
        first = values[0]
        if any(key in s and _per_token(s[key], n) for s, n in zip(samples, lengths, strict=True)):
            padded = torch.zeros(len(samples), width, dtype=first.dtype)
            for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
                if key in s:
                    padded[i, width - n:] = s[key][0]
            out[key] = padded
        else:
            out[key] = _join(values)
    return out


def media_feature() -> Any:
    """The column type of mm_inputs: safetensors bytes (empty for a row without media)."""
    import datasets

    return datasets.Value("binary")


def media_kept(media_spans: list[tuple[int, int]], positions: list[int]) -> bool:
    """Whether every media span survives truncation whole (the model needs all its tokens or none)."""
    kept = set(positions)
    return all(all(p in kept for p in range(a, b)) for a, b in media_spans)


def pack_tensors(tensors: dict[str, Any], positions: list[int]) -> bytes:
    """The sample's tensors as safetensors bytes, per-token ones cut to the kept positions."""
    import torch
    from safetensors.torch import save

    index = torch.tensor(positions, dtype=torch.long)
    cut = {k: (v.index_select(0, index) if k.startswith(TOKEN_PREFIX) else v).contiguous() for k, v in tensors.items()}
    return save(cut)


def unpack_tensors(blob: bytes | None) -> dict[str, Any]:
    if not blob:
        return {}
    from safetensors.torch import load

    return load(blob)


def join_blobs(blobs: list[bytes | None]) -> bytes:
    """Several samples' stored tensors as one row's (packing: the samples back to back), joined as collate_media
    joins a flat batch: per-token tensors concatenated, the others along their first dimension."""
    import torch
    from safetensors.torch import save

    samples = [unpack_tensors(b) for b in blobs]
    joined = {}
    for key in sorted({k for sample in samples for k in sample}):
        values = [sample[key] for sample in samples if key in sample]
        if key.startswith(TOKEN_PREFIX) and len(values) < len(samples):
            raise ValueError(f"per-token input {key} is missing from some samples of the row")
        joined[key] = (torch.cat(values) if key.startswith(TOKEN_PREFIX) else _join(values)).contiguous()
    return save(joined) if joined else b""


def collate_media(blobs: list[bytes | None], width: int | None) -> dict[str, Any]:
    """The model inputs of a batch's media: each sample's tensors joined along their first dimension (padded with
    zeros where their other dimensions differ, as processors pad a batch); per-token tensors padded to the batch's
    width with 0 (width None: one flat row, concatenated)."""
    import torch

    samples = [unpack_tensors(b) for b in blobs]
    keys = sorted({k for s in samples for k in s})
    out: dict[str, Any] = {}
    for key in keys:
        values = [s.get(key) for s in samples]
        if key.startswith(TOKEN_PREFIX):
            if any(v is None for v in values):
                raise ValueError(f"per-token input {key} is missing from some rows of the batch")
            name = key[len(TOKEN_PREFIX):]
            if width is None:
                out[name] = torch.cat(values).unsqueeze(0)
            else:
                padded = torch.zeros(len(values), width, dtype=values[0].dtype)
                for i, v in enumerate(values):
                    padded[i, : v.shape[0]] = v
                out[name] = padded
            continue
        present = [v for v in values if v is not None]
        out[key] = _join(present)
    return out


def _join(tensors: list[Any]) -> Any:
    import torch

    if len({tuple(t.shape[1:]) for t in tensors}) == 1:
        return torch.cat(tensors)
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        room = torch.zeros((t.shape[0], *shape), dtype=t.dtype)
        room[tuple(slice(0, n) for n in t.shape)] = t
        padded.append(room)
    return torch.cat(padded)
