"""Tiny random vision- and audio-language models of real families, saved as Hugging Face folders, for the unit tests
of multimodal training.

`build_family(name, out_dir)` writes one folder, fully offline: config.json + random fp32 weights
(model.safetensors), the family's tokenizer (the built-in SmolLM2 vocabulary plus the family's special tokens, with
the ids the config names), its image processor or feature extractor (preprocessor_config.json), processor_config.json
(the processor class and the kwargs its __init__ reads) and the family's official chat template (chat_template.jinja,
byte for byte what the real hub model ships). Each config starts from the family's Config class defaults, shrunk:
text hidden 64, 2 layers, 4 heads / 2 kv heads; vision / audio hidden 32, 2 layers; a handful of media tokens.

Processors with a video slot (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) need torchvision to be built by transformers'
AutoProcessor; where it cannot load, tuneforge's `load_processor` builds them without the video slot.
The folders are therefore written piece by piece rather than by `processor.save_pretrained`.

Chat templates (tests/fixtures/chat_templates/<family>.jinja): the hub is unreachable from here, so each is taken
from a public GitHub file that embeds the hub model's template verbatim:

- qwen2_vl (Qwen/Qwen2-VL-2B-Instruct): huggingface/transformers tests/models/qwen2_vl/test_processor_qwen2_vl.py
  (prepare_processor_dict, from Qwen/Qwen2-VL-7B-Instruct; the 2B ships the same); also
  openvinotoolkit/openvino.genai src/cpp/src/tokenizer.cpp (chat_template_fallback_map, "Qwen2-VL-2B-Instruct
  (tokenizer_config.json)") and huggingface/optimum-intel optimum/exporters/openvino/utils.py
  (COMPLEX_CHAT_TEMPLATES, "# qwen2-vl-instruct").
- qwen2_5_vl (Qwen/Qwen2.5-VL-3B-Instruct): huggingface/huggingface.js packages/jinja/test/e2e.test.js
  ("Qwen/Qwen2.5-VL-7B-Instruct"); the same text as Qwen2-VL's (also in huggingface/transformers
  tests/models/qwen2_5_vl/test_processor_qwen2_5_vl.py).
- qwen3_vl (Qwen/Qwen3-VL-2B-Instruct): zhongkaifu/TensorSharp InferenceWeb.Tests/QwenImageIntentScorerTests.cs
  (ShippedTemplate: the template of Qwen/Qwen3-VL-8B-Instruct, 5292 bytes, SHA-256 3636d0f0bd6b...a489e4 pinned
  there; the fixture has that hash). The Qwen3-VL Instruct sizes share one template.
- llava (llava-hf/llava-1.5-7b-hf): huggingface/optimum-intel optimum/exporters/openvino/utils.py
  (COMPLEX_CHAT_TEMPLATES, "# llava-1.5"); the same text is in huggingface/transformers
  tests/models/llava/test_processing_llava.py and openvinotoolkit/openvino.genai
  src/cpp/src/chat_template_fallback_map.hpp ("llava-hf/llava-1.5-7b-hf").
- llava_next (llava-hf/llava-v1.6-mistral-7b-hf): huggingface/optimum-intel optimum/exporters/openvino/utils.py
  (COMPLEX_CHAT_TEMPLATES, "# llava-next": the current template, which ends an assistant turn with '</s> '; the
  older one, "# llava-next old" there and in openvino.genai src/cpp/src/tokenizer.cpp, wrote '<\\s> ').
- gemma3 (google/gemma-3-4b-it): ShishirPatil/gorilla
  berkeley-function-call-leaderboard/bfcl_eval/model_handler/local_inference/gemma.py (the Gemma 3
  tokenizer_config.json "chat_template" value, quoted as JSON in GemmaHandler._format_prompt's docstring).
- smolvlm (HuggingFaceTB/SmolVLM-256M-Instruct): xi-ix/smolvlm_256m_ft SmolVLM-256M-Instruct/chat_template.json
  (a copy of the hub folder, at commit 5f64bb97372a9f9bb28b6e2d2f350229b97c2163; its config.json, processor_config.json
  and preprocessor_config.json are what _smolvlm mirrors); the same text is HuggingFaceTB/SmolVLM-Instruct's in
  huggingface/huggingface.js packages/jinja/test/e2e.test.js.
- qwen2_audio (Qwen/Qwen2-Audio-7B-Instruct): NOT verified against the hub file (no copy of it was found). The text
  is the chat template transformers shipped for this model when it was added, Qwen2AudioProcessor.default_chat_template
  in huggingface/transformers src/transformers/models/qwen2_audio/processing_qwen2_audio.py (commit
  0851a87dd4a49f695c1c0063d2b9d5bd2c844689; later versions also accept content['type'] == 'audio'), which is what
  renders transformers' hub-checkpoint test (tests/models/qwen2_audio/test_processing_qwen2_audio.py,
  test_chat_template).

- qwen2_5_omni (Qwen/Qwen2.5-Omni-7B): huggingface/transformers tests/models/qwen2_5_omni/test_processor_qwen2_5_omni.py
  (prepare_processor_dict, the template given with Qwen/Qwen2.5-Omni-7B's processor); the same text is quoted as
  that model family's template in public model cards and processors built on it (e.g. AVoCaDO-Captioner's card,
  with the same special-token ids as Qwen2.5-Omni-7B's added_tokens.json). Not checked against the hub file itself.
  The processor needs its video processor (torchvision) for videos; without one, images and audio still work.

No family of Idefics3-8B-Llama3 (HuggingFaceM4/Idefics3-8B-Llama3): its hub chat template was not found in any stored
public file, so it is left out rather than guessed; the Idefics3 architecture is covered by SmolVLM-256M-Instruct, an
Idefics3 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
PROJECT = Path(__file__).resolve().parents[1]

# text part shared by every family (the families' own text config classes, shrunk)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@dataclass
class _Parts:
    """What one family's folder is made of."""

    tokenizer: Any
    preprocessor: Any  # image processor or feature extractor
    processor_class: str
    config: Any
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    video_processor: dict[str, Any] | None = None  # video_preprocessor_config.json, for the families with videos
    audio_extractor: Any = None  # a feature extractor beside the image processor (omni models)


def chat_template(name: str) -> str:
    """The family's official chat template (exact text)."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def _tokenizer(named: dict[str, str] | None = None, extra: tuple[str, ...] = (), **special: str) -> Any:
    """The built-in SmolLM2 tokenizer with the family's special tokens added (ids after the 49152 base ones).

    `named`: tokens the processor reads as tokenizer attributes (tokenizer.image_token, .boi_token, ...), saved as
    model-specific special tokens; `extra`: further special tokens; `special`: bos_token / eos_token / pad_token."""
    from transformers import AutoTokenizer

    from tuneforge.model.hub import builtin_model_dir

    kwargs = {"extra_special_tokens": dict(named)} if named else {}
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_dir(), **kwargs)
    tokens = [*special.values(), *(named or {}).values(), *extra]
    tokenizer.add_special_tokens({**special, "extra_special_tokens": list(dict.fromkeys(tokens))},
                                 replace_extra_special_tokens=False)
    for key in ("is_local", "local_files_only"):  # how it was loaded here, not a property of the tokenizer
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def _ids(tokenizer: Any, **tokens: str) -> dict[str, int]:
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in tokens.items()}
    unknown = [key for key, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    assert not unknown, f"not in the vocabulary: {unknown}"
    return ids


def _text_ids(tokenizer: Any) -> dict[str, int]:
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


# ---------------------------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL


QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def _qwen_vl_tokenizer() -> tuple[Any, dict[str, int]]:
    tokenizer = _tokenizer(extra=("<|endoftext|>", *QWEN_VISION_TOKENS))
    ids = _ids(tokenizer, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
               vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
    return tokenizer, ids


def _qwen2_text(tokenizer: Any) -> dict[str, Any]:
    # Qwen2-VL-2B-Instruct: mrope_section [16, 24, 24] of a 64-wide rotary half; here a 8-wide one (Qwen2.5-VL too)
    return dict(TEXT, **_text_ids(tokenizer),
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]})


def _qwen2_image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28, patch_size=14,
                                    temporal_patch_size=2, merge_size=2)


# the video settings transformers derives from Qwen2-VL's image settings (the hub folder ships none)
QWEN2_VIDEO = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "temporal_patch_size": 2,
               "merge_size": 2, "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}}


def _qwen2_vl() -> _Parts:
    from transformers import Qwen2VLConfig

    tokenizer, ids = _qwen_vl_tokenizer()
    vision = dict(depth=2, embed_dim=32, hidden_size=TEXT["hidden_size"], num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=_qwen2_text(tokenizer), vision_config=vision, tie_word_embeddings=True, **ids)
    return _Parts(tokenizer, _qwen2_image_processor(), "Qwen2VLProcessor", config,
                  video_processor=dict(QWEN2_VIDEO, processor_class="Qwen2VLProcessor"))


def _qwen2_5_vl() -> _Parts:
    from transformers import Qwen2_5_VLConfig

    tokenizer, ids = _qwen_vl_tokenizer()
    # Qwen2.5-VL-3B-Instruct: windowed attention except in fullatt_block_indexes [7, 15, 23, 31] of 32 blocks
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=_qwen2_text(tokenizer), vision_config=vision, tie_word_embeddings=True,
                              **ids)
    return _Parts(tokenizer, _qwen2_image_processor(), "Qwen2_5_VLProcessor", config,
                  video_processor=dict(QWEN2_VIDEO, processor_class="Qwen2_5_VLProcessor"))


def _qwen3_vl() -> _Parts:
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig

    tokenizer, ids = _qwen_vl_tokenizer()
    # Qwen3-VL-2B-Instruct: interleaved mrope_section [24, 20, 20] of a 64-wide rotary half; here a 8-wide one
    text = dict(TEXT, **_text_ids(tokenizer), head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    # patch 16, learned position embeddings on a square grid (48 x 48 there, 8 x 8 here), deepstack features
    # taken after some vision blocks ([5, 11, 17] of 24 there) and added to the first text layers
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=4 * 32 * 32, max_pixels=64 * 32 * 32, patch_size=16,
                                               temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                                               image_std=[0.5, 0.5, 0.5])
    # Qwen3-VL ships its own video processor settings (Qwen3VLVideoProcessor; it needs torchvision to load);
    # without them transformers would infer Qwen2VLVideoProcessor from the image processor's
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
             "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}, "patch_size": 16,
             "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "fps": 2, "do_sample_frames": True}
    return _Parts(tokenizer, image_processor, "Qwen3VLProcessor", config, video_processor=video)


# ---------------------------------------------------------------------------------------------------------------
# LLaVA-1.5 / LLaVA-NeXT (CLIP ViT-L/14 at 336 px there; 56 px, 14 px patches here: 4 x 4 patches)


LLAVA_IMAGE = 56
LLAVA_VISION = dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
                    num_attention_heads=2, image_size=LLAVA_IMAGE, patch_size=14)
# the processor counts the CLS token the "default" strategy drops
LLAVA_PROCESSOR = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _llava() -> _Parts:
    from transformers import CLIPImageProcessorPil, LlavaConfig

    tokenizer = _tokenizer(extra=("<image>",), bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    seq_length = (LLAVA_IMAGE // 14) ** 2
    config = LlavaConfig(text_config=dict(TEXT, model_type="llama", **_text_ids(tokenizer)),
                         vision_config=dict(LLAVA_VISION, model_type="clip_vision_model"),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=seq_length,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                            crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})
    return _Parts(tokenizer, image_processor, "LlavaProcessor", config, dict(LLAVA_PROCESSOR, image_token="<image>"))


def _llava_next() -> _Parts:
    from transformers import LlavaNextConfig, LlavaNextImageProcessorPil

    tokenizer = _tokenizer(extra=("<image>",), bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    # llava-v1.6-mistral: [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], scaled to 56 px tiles
    pinpoints = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
    # the text model is Mistral's
    text = dict(TEXT, model_type="mistral", sliding_window=None, **_text_ids(tokenizer))
    config = LlavaNextConfig(text_config=text, vision_config=dict(LLAVA_VISION, model_type="clip_vision_model"),
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=pinpoints, image_seq_length=(LLAVA_IMAGE // 14) ** 2,
                             vision_feature_layer=-2, vision_feature_select_strategy="default")
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                                 crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE},
                                                 image_grid_pinpoints=pinpoints)
    return _Parts(tokenizer, image_processor, "LlavaNextProcessor", config, dict(LLAVA_PROCESSOR, image_token="<image>"))


# ---------------------------------------------------------------------------------------------------------------
# Gemma 3 (SigLIP at 896 px, 14 px patches, 64 x 64 patches pooled to 256 tokens there; 56 px: 4 x 4 -> 2 x 2 here)


def _gemma3() -> _Parts:
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    tokenizer = _tokenizer(named={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                  "eoi_token": "<end_of_image>"},
                           extra=("<start_of_turn>", "<end_of_turn>"),
                           bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    image_size, tokens = 56, 4
    text = dict(TEXT, **_text_ids(tokenizer), head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=14, vision_use_head=False)
    ids = _ids(tokenizer, image_token_index="<image_soft_token>", boi_token_index="<start_of_image>",
               eoi_token_index="<end_of_image>")
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens, **ids)
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size},
                                              image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return _Parts(tokenizer, image_processor, "Gemma3Processor", config, {"image_seq_length": tokens})


# ---------------------------------------------------------------------------------------------------------------
# Idefics3 / SmolVLM: an image is split in tiles of max_image_size plus a global view; each tile's patches are
# pixel-shuffled by scale_factor into image_seq_len tokens


IDEFICS_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                  *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))


def _smolvlm() -> _Parts:
    """SmolVLM-256M-Instruct as the hub ships it: an Idefics3 checkpoint (model_type idefics3, Idefics3Processor,
    Idefics3ImageProcessor) with SmolLM2's vocabulary and SmolVLM's tokens and template. (model_type "smolvlm" is
    SmolVLM2's, whose processor needs its video processor, i.e. torchvision, and num2words even for images.)"""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil

    tokenizer = _tokenizer(extra=IDEFICS_TOKENS, bos_token="<|im_start|>", eos_token="<|im_end|>",
                           pad_token="<|im_end|>")
    # SmolVLM-256M-Instruct: 512 px tiles, 16 px patches (32 x 32), scale factor 4 -> 64 tokens; 64 px, 8 px -> 4
    tile, patch, scale = 64, 8, 4
    seq_len = (tile // patch) ** 2 // scale**2
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=tile, patch_size=patch)
    config = Idefics3Config(text_config=dict(TEXT, model_type="llama", **_text_ids(tokenizer)), vision_config=vision,
                            scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            pad_token_id=tokenizer.pad_token_id)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile},
                                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return _Parts(tokenizer, image_processor, "Idefics3Processor", config, {"image_seq_len": seq_len})


# ---------------------------------------------------------------------------------------------------------------
# Qwen2-Audio: Whisper-style encoder over 128 log-mel bins of 30 s windows (3000 frames -> 1500 positions), pooled
# by 2 into the text model's embeddings


def _qwen2_audio() -> _Parts:
    from transformers import Qwen2AudioConfig, WhisperFeatureExtractor

    tokenizer = _tokenizer(extra=("<|endoftext|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"))
    audio = dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                 max_source_positions=1500)
    config = Qwen2AudioConfig(text_config=dict(TEXT, model_type="qwen2", **_text_ids(tokenizer)), audio_config=audio,
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30,
                                                return_attention_mask=True)
    return _Parts(tokenizer, feature_extractor, "Qwen2AudioProcessor", config)


# ---------------------------------------------------------------------------------------------------------------
# Qwen2.5-Omni: a thinker (Qwen2.5-VL's vision tower, a Whisper-style audio tower, a Qwen2 text model) that writes
# text, and a talker that speaks it (not built: enable_audio_output false, as tuneforge loads it). A video heard
# with its sound (use_audio_in_video) interleaves 2-second chunks of frames and audio inside one span.

OMNI_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
               "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
               "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}


def _qwen2_5_omni() -> _Parts:
    from transformers import Qwen2_5OmniConfig, WhisperFeatureExtractor

    tokenizer = _tokenizer(named=OMNI_TOKENS, extra=("<|endoftext|>", "<|vision_pad|>"))
    ids = _ids(tokenizer, audio_token_index="<|AUDIO|>", image_token_index="<|IMAGE|>",
               video_token_index="<|VIDEO|>", audio_start_token_id="<|audio_bos|>", audio_end_token_id="<|audio_eos|>",
               vision_start_token_id="<|vision_bos|>", vision_end_token_id="<|vision_eos|>")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    # Qwen2.5-Omni-7B: 32 layers of width 1280 over 128 mel bins, pooled into 3584-wide text embeddings
    audio = dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                 max_source_positions=1500, output_dim=TEXT["hidden_size"], n_window=100)
    thinker = dict(text_config=_qwen2_text(tokenizer), vision_config=vision, audio_config=audio,
                   position_id_per_seconds=25, seconds_per_chunk=2, **ids)
    talker = dict(vocab_size=len(tokenizer), **{key: ids["vision_start_token_id"] for key in (
        "tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id")})
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, enable_audio_output=False)
    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30,
                                                return_attention_mask=True)
    return _Parts(tokenizer, _qwen2_image_processor(), "Qwen2_5OmniProcessor", config, audio_extractor=feature_extractor,
                  video_processor=dict(QWEN2_VIDEO, processor_class="Qwen2_5OmniProcessor"))


_BUILDERS: dict[str, Callable[[], _Parts]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "llava": _llava,
    "llava_next": _llava_next,
    "gemma3": _gemma3,
    "smolvlm": _smolvlm,
    "qwen2_audio": _qwen2_audio,
    "qwen2_5_omni": _qwen2_5_omni,
}
# the families of the shared family tests; the omni model has its own (tests/data/test_media_omni.py): its
# processor needs torchvision even for images
FAMILIES: tuple[str, ...] = tuple(name for name in _BUILDERS if name != "qwen2_5_omni")


def shape_prompts(root: Path) -> list[dict]:
    """Our shapes rows as prompts with an answer column: each picture's question, answered with its color."""
    rows = json.loads((PROJECT / "data" / "shapes_train.json").read_text())[:4]
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(PROJECT / "data" / "shapes", root / "shapes", dirs_exist_ok=True)
    prompts = [{"messages": row["messages"][:1], "images": row["images"],
                "answer": row["messages"][1]["content"].split()[1]} for row in rows]
    (root / "prompts.json").write_text(json.dumps(prompts))
    (root / "dataset_info.json").write_text(json.dumps({"prompts": {
        "file_name": "prompts.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return prompts


def video_processors_load() -> bool:
    """Whether transformers' video processors can be built here: they need a torchvision that loads beside this
    torch (its PyPI build needs the CUDA torch) and a video decoder (PyAV or OpenCV)."""
    from transformers.utils import is_torchvision_available

    from tuneforge.data.media import video_decoder

    if not is_torchvision_available() or video_decoder() is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # a torchvision built for another torch fails on import
        return False
    return True


NO_VIDEO_REASON = ("transformers' video processors need torchvision (and PyAV or OpenCV to decode); this torch "
                   "cannot load torchvision")


def build_family(name: str, out_dir: Path) -> Path:
    """Write a tiny random `name` model (one of FAMILIES, or qwen2_5_omni) as a Hugging Face folder at out_dir."""
    import torch
    from transformers import AutoModelForMultimodalLM

    if name not in _BUILDERS:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(_BUILDERS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = _BUILDERS[name]()
    template = chat_template(name)

    parts.tokenizer.chat_template = template
    parts.tokenizer.save_pretrained(out)
    parts.preprocessor.save_pretrained(out)
    if parts.audio_extractor is not None:  # one preprocessor_config.json holds both, as the omni hub folders ship it
        both = {**parts.audio_extractor.to_dict(), **json.loads((out / "preprocessor_config.json").read_text())}
        (out / "preprocessor_config.json").write_text(json.dumps(both, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    if parts.video_processor is not None:
        (out / "video_preprocessor_config.json").write_text(
            json.dumps(parts.video_processor, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    processor_config = {"processor_class": parts.processor_class, **parts.processor_kwargs}
    (out / "processor_config.json").write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")

    torch.manual_seed(0)
    model = AutoModelForMultimodalLM.from_config(parts.config, dtype=torch.float32)
    with torch.no_grad():  # weights some families start at zero (Gemma 3's projection): random, so media matter
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(std=0.02)
    model.save_pretrained(out)
    if hasattr(model, "load_speakers"):  # an omni model's voices, which its from_pretrained reads (none here)
        torch.save({}, out / "spk_dict.pt")
    return out
