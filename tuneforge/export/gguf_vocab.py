"""The tokenizer part of a GGUF file: gpt2-style (byte-level BPE) tokens, token types, merges, the
pre-tokenizer's llama.cpp name, special token ids, the add-bos / add-eos flags and the chat template."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from tuneforge.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)


def gguf_package():
    try:
        import gguf
    except ImportError:
        raise ConfigError("export_format gguf needs the gguf package: pip install gguf") from None
    return gguf


def check_tokenizer(tokenizer: Any, source: str) -> None:
    """Raise ConfigError unless the tokenizer is a fast byte-level BPE one (what GGUF's gpt2 model means)."""
    spec = _tokenizer_spec(tokenizer)
    model = (spec or {}).get("model", {})
    if spec is None or model.get("type") != "BPE" or model.get("byte_fallback") or not _is_byte_level(spec):
        raise ConfigError(
            f"{source}: export_format gguf supports byte-level BPE tokenizers (tokenizer.json like GPT-2, "
            f"Llama 3, SmolLM); this tokenizer is not one. Export with export_format: safetensors and convert "
            f"with llama.cpp's convert_hf_to_gguf.py"
        )


def _tokenizer_spec(tokenizer: Any) -> dict | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else None


def _parts(pre: dict | None) -> list[dict]:
    if not pre:
        return []
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre]


def _is_byte_level(spec: dict) -> bool:
    return any(p.get("type") == "ByteLevel" for p in _parts(spec.get("pre_tokenizer")))


def _known_splits() -> dict[str, str]:
    """llama.cpp pre-tokenizer names by split regex, from transformers' GGUF reader (its inverse)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return {}
    names: dict[str, str] = {}
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        names.setdefault(regex, name)
    return names


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE ('default' when not recognized)."""
    parts = _parts(spec.get("pre_tokenizer"))
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        name = _known_splits().get((parts[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    logger.warning("gguf: the tokenizer's pre-tokenizer (%s) has no llama.cpp name; writing 'default'", kinds)
    return "default"


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str


def gguf_vocab(tokenizer: Any, vocab_size: int) -> Vocab:
    """Tokens in id order (padded to the embedding size), their types, the merges and the pre-tokenizer."""
    gguf = gguf_package()
    spec = _tokenizer_spec(tokenizer) or {}
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise ModelError(f"the tokenizer has {max(by_id) + 1} tokens but the model's embeddings only {vocab_size} "
                         f"rows; resize the model's embeddings to the tokenizer")
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec.get("model", {}).get("merges", [])]
    return Vocab(tokens, [int(t) for t in types], merges, pre_tokenizer_name(spec))


def _adds(tokenizer: Any, token_id: int | None, where: int) -> bool:
    """Whether encoding text adds `token_id` at position `where` (0: bos, -1: eos)."""
    if token_id is None:
        return False
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[where] == token_id


def write_tokenizer(writer: Any, tokenizer: Any, chat_template: str | None, vocab_size: int,
                     eot_id: int | None) -> None:
    vocab = gguf_vocab(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for token_id, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                          (tokenizer.eos_token_id, writer.add_eos_token_id),
                          (tokenizer.unk_token_id, writer.add_unk_token_id),
                          (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    if eot_id is not None and eot_id != tokenizer.eos_token_id:
        writer.add_eot_token_id(eot_id)
    writer.add_add_bos_token(_adds(tokenizer, tokenizer.bos_token_id, 0))
    writer.add_add_eos_token(_adds(tokenizer, tokenizer.eos_token_id, -1))
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template:
        writer.add_chat_template(template)
