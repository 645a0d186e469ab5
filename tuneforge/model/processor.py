"""The processor of a vision- or audio-language model: its own image / video / audio processors, tokenizer and
chat template, which decide how media become tokens (tuneforge keeps no per-family copy of that).

A text-only model has no processor: `load_processor` returns None and everything runs on the tokenizer.

transformers' video processors need torchvision. Where it cannot load (a CPU-only torch wheel beside
torchvision's PyPI build, whose compiled ops need the CUDA torch), a processor whose family has a video slot is
built without it: images (through the PIL image processors) and audio work, and a video in the data is refused
before tokenizing with what to install (data.media.check_media).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tuneforge.errors import ModelError

logger = logging.getLogger(__name__)

VIDEO_SLOT = "video_processor"
PROCESSOR_CONFIG = "processor_config.json"


def is_multimodal(config: Any) -> bool:
    """True for a vision- / audio-language model: a model type transformers' multimodal LM mapping knows whose
    config holds a vision or audio part (a text-only Gemma 3 or Qwen is in that mapping too, without one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) not in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return False
    parts = ("vision_config", "audio_config", "thinker_config", "vision_tower", "audio_tower")
    return any(getattr(config, key, None) is not None for key in parts)


def _processor_class(path: Path, trust_remote_code: bool) -> type:
    """The processor class the folder names (processor_config.json), else the one of its model type."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    saved = path / PROCESSOR_CONFIG
    name = json.loads(saved.read_text(encoding="utf-8")).get("processor_class") if saved.is_file() else None
    if name and hasattr(transformers, name):
        return getattr(transformers, name)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    try:
        return PROCESSOR_MAPPING[type(config)]
    except KeyError:
        raise ModelError(f"{path}: transformers knows no processor for model type {config.model_type}") from None


def _video_settings(path: Path) -> dict[str, Any] | None:
    """The model folder's video processor settings, found as transformers finds them: the entry in
    processor_config.json, else video_preprocessor_config.json, else preprocessor_config.json."""
    nested = path / PROCESSOR_CONFIG
    if nested.is_file():
        settings = json.loads(nested.read_text(encoding="utf-8")).get(VIDEO_SLOT)
        if settings is not None:
            return settings
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (path / name).is_file():
            return json.loads((path / name).read_text(encoding="utf-8"))
    return None


def _without_video(cls: type, video_settings: dict[str, Any] | None) -> type:
    """The processor class with its video slot left out (its other slots and methods unchanged). It saves the
    model's video processor settings as they were, so a saved folder loads whole where torchvision is installed."""
    slots = [name for name in cls.get_attributes() if name != VIDEO_SLOT]

    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        written = cls.save_pretrained(self, save_directory, *args, **kwargs)
        target = Path(save_directory) / PROCESSOR_CONFIG
        if video_settings is not None and target.is_file():
            settings = json.loads(target.read_text(encoding="utf-8"))
            settings[VIDEO_SLOT] = video_settings
            target.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return written

    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _cls: list(slots)),
                                       "save_pretrained": save_pretrained, "__module__": cls.__module__})


def load_processor(path: Path, config: Any, *, trust_remote_code: bool = False) -> Any | None:
    """The model's processor, or None for a text-only model."""
    if not is_multimodal(config):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise ModelError(f"cannot load the processor of {path}: {e}") from None
        cls = _processor_class(path, trust_remote_code)
        if VIDEO_SLOT not in cls.get_attributes():
            raise ModelError(f"cannot load the processor of {path}: {e}") from None
        try:
            processor = _without_video(cls, _video_settings(path)).from_pretrained(path,
                                                                                  trust_remote_code=trust_remote_code)
        except TypeError:  # a processor that hands its slots on by position (Qwen2.5-Omni) cannot leave one out
            raise ModelError(f"{cls.__name__} cannot be built without its video processor, which needs torchvision "
                             f"({e}); install torch and torchvision as a pair that loads together (a tuneforge "
                             f"checkout's scripts/setup.sh --vision)") from None
        logger.info("%s: torchvision is not available, so the processor has no video processor (images and "
                    "audio work; videos need torchvision)", path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load the processor of {path}: {e}. A vision- or audio-language model's folder "
                         f"needs its processor files (processor_config.json / preprocessor_config.json)") from None
    if getattr(processor, "chat_template", None) is None:
        raise ModelError(f"the processor of {path} has no chat template (chat_template.jinja or "
                         f"chat_template.json); tuneforge renders media with the model's own template")
    return processor
