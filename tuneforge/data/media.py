"""The media of a row: where each image (video, audio) is, opened and prepared as LlamaFactory prepares it before
the model's processor sees it.

A row names its media in its `images` / `videos` / `audios` columns (LlamaFactory's layout): paths relative to
`media_dir` (default: dataset_dir), absolute paths, http(s) URLs, or media already decoded by `datasets`
(an Image feature in parquet / arrow: a PIL image, or {"bytes": ..., "path": ...}). The messages mark where each
one goes with a placeholder (`<image>`, `<video>`, `<audio>`; LlamaFactory's IMAGE_PLACEHOLDER, ... environment
variables rename them), in order.

A video is decoded only at the frames it keeps: the model's own video processor picks them (its sample_frames at
video_fps, at most video_maxlen frames), so a family's rules (Qwen2-VL's even frame counts, its minimum of four)
hold; the processor is then told not to sample again.

A file that is missing or cannot be decoded is a BadRow naming the file: the encoder adds the dataset and row.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.data.formats import BadRow
from tuneforge.errors import DataError

KINDS = ("image", "video", "audio")
SOUND = "video_sound"  # use_audio_in_video: what each video is heard with (multimodal.video_sound)
COLUMN_OF = {"image": "images", "video": "videos", "audio": "audios"}
DEFAULT_PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


def placeholders() -> dict[str, str]:
    """kind -> the placeholder text in the messages (LlamaFactory's environment variables may rename them)."""
    return {kind: os.environ.get(f"{kind.upper()}_PLACEHOLDER", text) for kind, text in DEFAULT_PLACEHOLDERS.items()}


@dataclass(frozen=True)
class MediaSettings:
    """How media are found and prepared (the model group's image_* / video_* / audio_* keys, data's media_dir)."""

    media_dir: str = "."
    image_max_pixels: int = 768 * 768
    image_min_pixels: int = 32 * 32
    image_do_pan_and_scan: bool = False  # passed to the processor (Gemma 3's crops of large images)
    crop_to_patches: bool = False  # passed to the processor (InternVL-style tiling)
    video_max_pixels: int = 256 * 256
    video_min_pixels: int = 16 * 16
    video_fps: float = 2.0
    video_maxlen: int = 128
    audio_sampling_rate: int = 16000
    use_audio_in_video: bool = False  # omni models: each video is heard with its sound

    @classmethod
    def from_config(cls, cfg: Any) -> MediaSettings:
        m, d = cfg.model, cfg.data
        return cls(media_dir=d.media_dir or d.dataset_dir, image_max_pixels=m.image_max_pixels,
                   image_min_pixels=m.image_min_pixels, image_do_pan_and_scan=m.image_do_pan_and_scan,
                   crop_to_patches=m.crop_to_patches, video_max_pixels=m.video_max_pixels,
                   video_min_pixels=m.video_min_pixels, video_fps=m.video_fps, video_maxlen=m.video_maxlen,
                   audio_sampling_rate=m.audio_sampling_rate, use_audio_in_video=m.use_audio_in_video)

    def processor_kwargs(self) -> dict[str, Any]:
        """The image options the user turned on, as the processors name them."""
        return {key: True for key, on in (("do_pan_and_scan", self.image_do_pan_and_scan),
                                          ("crop_to_patches", self.crop_to_patches)) if on}


def row_media(row: dict[str, Any], columns: dict[str, str | None]) -> dict[str, list[Any]]:
    """kind -> the row's references of that kind, in order (a single reference counts as a list of one)."""
    out: dict[str, list[Any]] = {}
    for kind in KINDS:
        column = columns.get(COLUMN_OF[kind])
        value = row.get(column) if column else None
        if value is None:
            continue
        refs = value if isinstance(value, list) else [value]
        if refs:
            out[kind] = refs
    return out


def _describe(ref: Any) -> str:
    if isinstance(ref, dict):
        return str(ref.get("path") or "an embedded file")
    return str(ref) if isinstance(ref, (str, os.PathLike)) else f"a {type(ref).__name__}"


def _resolved(ref: str, settings: MediaSettings) -> Path:
    path = Path(ref).expanduser()
    return path if path.is_absolute() else Path(settings.media_dir) / path


def local_file(ref: Any, settings: MediaSettings) -> Path | None:
    """The local file a media reference names, resolved; None for a URL, an embedded medium or a missing file."""
    path = ref.get("path") if isinstance(ref, dict) and not ref.get("bytes") else ref
    if not isinstance(path, (str, os.PathLike)) or _is_url(path):
        return None
    file = _resolved(str(path), settings)
    return file.resolve() if file.is_file() else None


def _local_path(ref: str, settings: MediaSettings, kind: str) -> Path:
    path = _resolved(ref, settings)
    if not path.is_file():
        raise BadRow(f"{kind} file {ref} does not exist (looked for {path}; relative paths start at media_dir, "
                     f"default dataset_dir)")
    return path


def _is_url(ref: Any) -> bool:
    return isinstance(ref, str) and ref.startswith(("http://", "https://"))


def _fetched(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (http(s) only: _is_url)
        return response.read()


def load_image(ref: Any, settings: MediaSettings) -> Any:
    """One image as an RGB PIL image, scaled into [image_min_pixels, image_max_pixels] (aspect ratio kept)."""
    from PIL import Image

    try:
        if isinstance(ref, Image.Image):
            image = ref
        elif isinstance(ref, dict) and ref.get("bytes"):
            image = Image.open(io.BytesIO(ref["bytes"]))
        elif isinstance(ref, dict) and ref.get("path"):
            image = Image.open(_local_path(ref["path"], settings, "image"))
        elif _is_url(ref):
            from transformers.image_utils import load_image as fetch

            image = fetch(ref)
        elif isinstance(ref, (str, os.PathLike)):
            image = Image.open(_local_path(str(ref), settings, "image"))
        else:
            raise BadRow(f"an image must be a path, a URL or an image, got {type(ref).__name__}")
        image.load()
    except BadRow:
        raise
    except Exception as e:  # PIL raises several kinds for a broken or unknown file; the user needs the file named
        raise BadRow(f"image {_describe(ref)} cannot be read: {e}") from None
    return _scaled(image.convert("RGB"), settings.image_min_pixels, settings.image_max_pixels)


def _scaled(image: Any, min_pixels: int, max_pixels: int) -> Any:
    """The image scaled (aspect ratio kept) so its pixel count lies in [min_pixels, max_pixels]."""
    pixels = image.width * image.height
    if pixels > max_pixels:
        factor = math.sqrt(max_pixels / pixels)
    elif pixels < min_pixels:
        factor = math.sqrt(min_pixels / pixels)
    else:
        return image
    size = (max(1, int(image.width * factor)), max(1, int(image.height * factor)))
    return image.resize(size)


VIDEO_DECODERS = (("av", "pyav"), ("cv2", "opencv"), ("decord", "decord"))  # module, transformers' backend name


def video_decoder() -> str | None:
    """transformers' name of the first installed video decoder (PyAV, as LlamaFactory uses, else OpenCV, Decord)."""
    import importlib.util

    return next((backend for module, backend in VIDEO_DECODERS if importlib.util.find_spec(module)), None)


def frame_sampler(video_processor: Any, settings: MediaSettings) -> Any:
    """The frames to keep of one video, given its metadata: the video processor's own choice at video_fps, or
    video_maxlen frames spread over the video where that choice holds more."""

    def sample(metadata: Any, **_: Any) -> Any:
        indices = video_processor.sample_frames(metadata, fps=settings.video_fps)
        if len(indices) > settings.video_maxlen:
            indices = video_processor.sample_frames(metadata, num_frames=settings.video_maxlen)
        return indices

    return sample


@contextlib.contextmanager
def _video_file(ref: Any, settings: MediaSettings) -> Iterator[str]:
    """A video reference as a local file name (bytes and URLs written to a temporary file: decoders read files)."""
    import tempfile

    if isinstance(ref, dict) and ref.get("bytes") or _is_url(ref):
        with tempfile.NamedTemporaryFile(suffix=".video") as held:
            held.write(_fetched(ref) if _is_url(ref) else ref["bytes"])
            held.flush()
            yield held.name
        return
    path = ref.get("path") if isinstance(ref, dict) else ref
    if not isinstance(path, (str, os.PathLike)):
        raise BadRow(f"a video must be a path or a URL, got {type(ref).__name__}")
    yield str(_local_path(str(path), settings, "video"))


def load_video(ref: Any, settings: MediaSettings, processor: Any) -> tuple[Any, Any]:
    """One video as (frames, metadata): its sampled frames (T, H, W, 3 uint8, each scaled into
    [video_min_pixels, video_max_pixels]) and transformers' VideoMetadata (fps, frames_indices: Qwen3-VL writes
    the frames' timestamps from them)."""
    import numpy as np
    from PIL import Image
    from transformers.video_utils import VIDEO_DECODERS as DECODE

    backend = video_decoder()
    if backend is None:
        raise DataError("reading videos needs PyAV: pip install 'tuneforge[video]'")
    try:
        with _video_file(ref, settings) as source:
            frames, metadata = DECODE[backend](source, frame_sampler(processor.video_processor, settings))
    except (BadRow, DataError):
        raise
    except Exception as e:  # decoders raise their own kinds for a broken or unknown file; the user needs it named
        raise BadRow(f"video {_describe(ref)} cannot be read: {e}") from None
    if len(frames) == 0:
        raise BadRow(f"video {_describe(ref)} has no frames to read")
    scaled = [np.asarray(_scaled(Image.fromarray(frame), settings.video_min_pixels, settings.video_max_pixels))
              for frame in frames]
    return np.stack(scaled), metadata


def load_soundtrack(ref: Any, settings: MediaSettings) -> Any:
    """A video's own audio track as load_audio gives a clip (PyAV decodes and resamples it to mono float32)."""
    import numpy as np

    try:
        import av
    except ImportError:
        raise DataError("hearing a video's audio track needs PyAV: pip install 'tuneforge[video]'") from None
    try:
        with _video_file(ref, settings) as source, av.open(source) as container:
            if not container.streams.audio:
                raise BadRow(f"video {_describe(ref)} has no audio track to hear (use_audio_in_video); give its "
                             f"sound in the row's audios column, one per video, or set use_audio_in_video: false")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=settings.audio_sampling_rate)
            chunks = [out.to_ndarray().reshape(-1) for frame in container.decode(audio=0)
                      for out in resampler.resample(frame)]
            chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except (BadRow, DataError):
        raise
    except Exception as e:  # a broken container or stream
        raise BadRow(f"the audio track of video {_describe(ref)} cannot be read: {e}") from None
    return np.ascontiguousarray(np.concatenate(chunks) if chunks else np.zeros(0), dtype=np.float32)


def load_audio(ref: Any, settings: MediaSettings) -> Any:
    """One audio clip as a mono float32 numpy array at audio_sampling_rate (soundfile decodes wav / flac / mp3 /
    ogg; soxr resamples: `pip install 'tuneforge[audio]'`)."""
    import numpy as np

    try:
        import soundfile
        import soxr
    except ImportError:
        raise DataError("reading audio needs soundfile and soxr: pip install 'tuneforge[audio]'") from None
    try:
        if isinstance(ref, dict) and ref.get("array") is not None:  # decoded by datasets' Audio feature
            data, rate = np.asarray(ref["array"], dtype=np.float32), int(ref["sampling_rate"])
        else:
            if isinstance(ref, dict) and ref.get("bytes"):
                source: Any = io.BytesIO(ref["bytes"])
            elif isinstance(ref, dict) and ref.get("path"):
                source = _local_path(ref["path"], settings, "audio")
            elif _is_url(ref):
                source = io.BytesIO(_fetched(ref))
            elif isinstance(ref, (str, os.PathLike)):
                source = _local_path(str(ref), settings, "audio")
            else:
                raise BadRow(f"an audio clip must be a path or a URL, got {type(ref).__name__}")
            data, rate = soundfile.read(source, dtype="float32", always_2d=True)
            data = data.mean(axis=1)
    except BadRow:
        raise
    except Exception as e:  # soundfile raises LibsndfileError and others for a file it cannot decode
        raise BadRow(f"audio {_describe(ref)} cannot be read: {e}") from None
    if data.ndim > 1:
        data = data.mean(axis=-1)
    if rate != settings.audio_sampling_rate:
        data = soxr.resample(data, rate, settings.audio_sampling_rate)
    return np.ascontiguousarray(data, dtype=np.float32)


def load_media(media: dict[str, list[Any]], settings: MediaSettings, processor: Any) -> dict[str, list[Any]]:
    """kind -> the decoded media, ready for the processor (videos as (frames, metadata) pairs; SOUND: each video's
    sound, a clip of the row's audios or {"track": video} for the video's own audio track)."""
    loaders = {"image": load_image, "audio": load_audio,
               "video": lambda ref, s: load_video(ref, s, processor),
               SOUND: lambda ref, s: load_soundtrack(ref["track"], s) if isinstance(ref, dict) and "track" in ref
               else load_audio(ref, s)}
    return {kind: [loaders[kind](ref, settings) for ref in refs] for kind, refs in media.items()}


# ---------------------------------------------------------------- what a processor reads


def media_token(processor: Any, kind: str) -> str | None:
    """The text the processor expands for one image / video / audio (e.g. <|image_pad|>), or None."""
    return getattr(processor, f"{kind}_token", None)


def supported_media(processor: Any) -> set[str]:
    """The media kinds this processor can turn into tokens."""
    slots = {"image": ("image_processor",), "video": ("video_processor",),
             "audio": ("feature_extractor", "audio_processor")}
    return {kind for kind in KINDS
            if media_token(processor, kind) and any(getattr(processor, s, None) is not None for s in slots[kind])}


def check_media(processor: Any, kinds: set[str], where: str, hears_videos: bool = False) -> None:
    """Stop before tokenizing when the data holds media this model cannot read."""
    if not kinds:
        return
    if processor is None:
        raise DataError(f"{where} holds {', '.join(sorted(kinds))}, but the model is text-only; use a vision- or "
                        f"audio-language model (e.g. Qwen2-VL) or a text-only dataset")
    if "video" in kinds and hears_videos and not hears_video_sound(processor):
        raise DataError(f"{where} holds videos and use_audio_in_video is true, but {type(processor).__name__} cannot "
                        f"hear a video's sound (an omni model's processor can: Qwen2.5-Omni); set "
                        f"use_audio_in_video: false to see the videos without their sound")
    missing = kinds - supported_media(processor)
    if "video" in missing and media_token(processor, "video") and getattr(processor, "video_processor", None) is None:
        raise DataError(f"{where} holds videos; {type(processor).__name__}'s video processor needs torchvision, "
                        f"which this install cannot load: install torch and torchvision as a pair that loads "
                        f"together, both from one index (e.g. download.pytorch.org/whl/cpu), or on PyPI torch 2.14.1 "
                        f"with torchvision 0.29.1, as a tuneforge checkout's scripts/setup.sh --vision does")
    if missing:
        raise DataError(f"{where} holds {', '.join(sorted(missing))}, which {type(processor).__name__} cannot read; "
                        f"it reads {', '.join(sorted(supported_media(processor))) or 'no media'}")
    if "video" in kinds and video_decoder() is None:
        raise DataError(f"{where} holds videos; decoding them needs PyAV: pip install 'tuneforge[video]'")


def hears_video_sound(processor: Any) -> bool:
    """Whether the processor interleaves a video's sound with its frames (transformers' omni processors)."""
    from transformers.processing_utils import OmniModalProcessorMixin

    return isinstance(processor, OmniModalProcessorMixin) and supported_media(processor) >= {"video", "audio"}
