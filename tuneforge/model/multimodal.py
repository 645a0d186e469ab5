"""The parts of a vision- / audio-language model: the language model, the media encoders (vision / audio tower)
and the projector between them, found from transformers' own structure rather than per-family lists.

The language model is `model.get_decoder()` (transformers' multimodal models return their text model there);
everything else that holds weights, except the embeddings and the head, is the media side: a module on it whose
name says it projects into the language model (projector, merger, connector, aligner) is the projector, the rest
is the tower. An omni model (thinker + talker: Qwen2.5-Omni) writes its text with its thinker, the only part with a
training forward: tuneforge loads the thinker alone (`text_writer`) and trains, runs and saves it.
LlamaFactory's keys choose what trains:
- full / freeze: freeze_vision_tower (default true), freeze_multi_modal_projector (true), freeze_language_model;
- lora / oft: `all` adapts the language model's linear layers, and the tower's / projector's when the user
  unfreezes them (freeze_vision_tower / freeze_multi_modal_projector: false).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn

from tuneforge.model.processor import is_multimodal
from tuneforge.trunk import unwrapped

logger = logging.getLogger(__name__)

PROJECTOR_WORDS = re.compile(r"projector|merger|connector|aligner")


def language_model_path(model: nn.Module) -> str | None:
    """The module path of a multimodal model's language model (None for a text model)."""
    config = getattr(model, "config", None)
    if config is None or not is_multimodal(config) or not hasattr(model, "get_decoder"):
        return None
    decoder = model.get_decoder()
    return next((path for path, module in model.named_modules() if module is decoder and path), None)


def media_parts(model: nn.Module) -> dict[str, list[str]]:
    """{"tower": [...], "projector": [...]}: the top-most module paths of the media side of a multimodal model."""
    lm = language_model_path(model)
    if lm is None:
        return {"tower": [], "projector": []}
    keep = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    parts: dict[str, list[str]] = {"tower": [], "projector": []}
    for path, module in model.named_modules():
        if not path or id(module) in keep or path == lm or path.startswith(lm + ".") or lm.startswith(path + "."):
            continue
        if any(path.startswith(p + ".") for p in parts["tower"] + parts["projector"]):
            continue
        if next(module.parameters(), None) is None:
            continue
        if PROJECTOR_WORDS.search(path.rsplit(".", 1)[-1]):
            parts["projector"].append(path)
        elif not any(PROJECTOR_WORDS.search(sub) for sub, _ in module.named_modules() if sub):
            parts["tower"].append(path)
        # else: a tower that holds its projector (Qwen2-VL's visual.merger): its children are visited next
    return parts


def freeze_media_side(model: nn.Module, *, tower: bool, projector: bool, language_model: bool) -> None:
    """full / freeze: stop the gradients of the parts the freeze_* keys name."""
    parts = media_parts(model)
    frozen = (parts["tower"] if tower else []) + (parts["projector"] if projector else [])
    lm = language_model_path(model)
    if language_model and lm:
        frozen.append(lm)
    modules = dict(model.named_modules())
    for path in frozen:
        modules[path].requires_grad_(False)
    if frozen:
        logger.info("frozen: %s", ", ".join(frozen))


def adapted_paths(model: nn.Module, linear_paths: list[str], *, tower: bool, projector: bool) -> list[str]:
    """lora / oft `all` on a multimodal model: the linear layers (full paths) of the language model, plus those of
    the tower / projector when they are not frozen (tower / projector: whether they stay frozen)."""
    lm = language_model_path(model)
    parts = media_parts(model)
    roots = [lm] + ([] if tower else parts["tower"]) + ([] if projector else parts["projector"])
    return [p for p in linear_paths if any(p.startswith(root + ".") for root in roots)]


def rope_index(model: nn.Module) -> Any | None:
    """The model's own 3-D rope placement (Qwen2-VL's get_rope_index and its kin), or None for a model with 1-D
    positions."""
    base = unwrapped(model)
    return getattr(getattr(base, "model", base), "get_rope_index", None) or getattr(base, "get_rope_index", None)


def omni_without_talker(config: Any) -> Any:
    """An omni model's config set to build no talker (its speech side), which tuneforge neither trains nor runs."""
    if getattr(config, "thinker_config", None) is not None and getattr(config, "enable_audio_output", False):
        config.enable_audio_output = False
    return config


def text_writer(model: nn.Module) -> nn.Module:
    """The part of a loaded model that writes text: an omni model's thinker (its whole model has no training
    forward), else the model itself."""
    thinker = getattr(model, "thinker", None)
    return thinker if isinstance(thinker, nn.Module) and getattr(model.config, "thinker_config", None) else model


def hear_videos(model: nn.Module) -> None:
    """use_audio_in_video: the processor interleaved each video's sound with its frames, so the model's rope
    placement (its only reader of the flag) is told so on every call: training, generate and the collator's."""
    import functools
    import inspect

    for module in model.modules():
        index = getattr(module, "get_rope_index", None)
        if index is None or "use_audio_in_video" not in inspect.signature(index).parameters:
            continue
        signature = inspect.signature(index)

        @functools.wraps(index)
        def with_sound(*args: Any, _index: Any = index, _signature: Any = signature, **kwargs: Any) -> Any:
            bound = _signature.bind(*args, **kwargs)
            bound.arguments["use_audio_in_video"] = True
            return _index(*bound.args, **bound.kwargs)

        module.get_rope_index = with_sound


def media_packing_refusal(model: nn.Module) -> str:
    """Why a multimodal model's samples cannot share a row (padding-free, packing) with their media; "" when they
    can: causal attention over the media tokens, and 1-D positions or 3-D rope ones the collator places per
    sample (rope_positions; transformers' Qwen-VL families read a packed row's text positions beside them)."""
    import inspect

    base = unwrapped(model)
    parameters = set(inspect.signature(base.forward).parameters)
    if "token_type_ids" in parameters:
        return f"{type(base).__name__} attends both ways within an image (token_type_ids), across samples in one row"
    if "mm_token_type_ids" in parameters and rope_index(model) is None:
        return f"{type(base).__name__} reads per-token media types (mm_token_type_ids) without a rope placement"
    index = rope_index(model)
    derived = set(inspect.signature(index).parameters) - parameters if index is not None else set()
    if derived:  # e.g. Qwen2.5-Omni's audio_seqlens: the model derives them from its inputs itself
        return (f"{type(base).__name__}'s rope placement reads {', '.join(sorted(derived))}, which the model "
                f"derives from a whole batch, not per sample")
    return ""


def rope_positions(model: nn.Module) -> Any | None:
    """For a model with 3-D rope positions: a function (input_ids (1, n), the row's media inputs as the model takes
    them) -> the row's positions (3, n), from the model's own get_rope_index on that row alone; None for 1-D
    positions."""
    import inspect

    index = rope_index(model)
    if index is None:
        return None
    accepted = set(inspect.signature(index).parameters)

    def positions(input_ids: Any, inputs: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad():
            placed, _ = index(input_ids=input_ids, **{k: v for k, v in inputs.items() if k in accepted})
        return placed[:, 0]

    return positions


def family_media_packing(config: Any, *, trust_remote_code: bool = False) -> str:
    """media_packing_refusal for the model a config describes, from its structure alone (built on the meta
    device: no weights, no memory)."""
    import torch
    from transformers import AutoModelForMultimodalLM

    with torch.device("meta"):
        model = AutoModelForMultimodalLM.from_config(omni_without_talker(config), trust_remote_code=trust_remote_code)
    return media_packing_refusal(text_writer(model))
