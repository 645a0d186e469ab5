"""The new-token keys (LlamaFactory's add_tokens, add_special_tokens, new_special_tokens_config, resize_vocab,
init_special_tokens): what they ask for, read and checked with the rest of the config before anything loads.
model/vocab.py adds the tokens to the tokenizer and grows and initialises the embeddings."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tuneforge.config.schema import ModelArgs, RunConfig
from tuneforge.errors import ConfigError

logger = logging.getLogger(__name__)

INIT_METHODS = ("noise_init", "desc_init", "desc_init_w_noise")
DESCRIPTIONS_KEY = "new_special_tokens_config"


@dataclass(frozen=True)
class NewTokens:
    """The tokens a config adds: plain ones (add_tokens), special ones (add_special_tokens, or the keys of
    new_special_tokens_config, which then wins as in LlamaFactory) and the special ones' descriptions."""

    plain: tuple[str, ...] = ()
    special: tuple[str, ...] = ()
    descriptions: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.plain or self.special)


def requested_tokens(m: ModelArgs) -> NewTokens:
    """The new tokens of a config; ConfigError for an empty or repeated token or a bad descriptions file."""
    descriptions = read_descriptions(m.new_special_tokens_config) if m.new_special_tokens_config else {}
    special = tuple(descriptions) if descriptions else tuple(m.add_special_tokens or ())
    if descriptions and m.add_special_tokens and list(m.add_special_tokens) != list(descriptions):
        logger.warning("both new_special_tokens_config and add_special_tokens are set: adding the config's tokens "
                       "%s (as LlamaFactory does)", list(descriptions))
    plain = tuple(m.add_tokens or ())
    for key, tokens in (("add_tokens", plain), ("add_special_tokens", special)):
        if any(not t.strip() for t in tokens):
            raise ConfigError(f"{key}: a token is empty; write the tokens comma-separated, e.g. <tool>,<result>",
                              key=key)
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        if repeated:
            raise ConfigError(f"{key}: {', '.join(repeated)} is listed more than once", key=key)
    both = sorted(set(plain) & set(special))
    if both:
        raise ConfigError(f"{', '.join(both)} is in add_tokens and in the special tokens; a token is either plain "
                          f"or special: keep it in one of them", key=("add_tokens", "add_special_tokens"))
    return NewTokens(plain, special, descriptions)


def read_descriptions(value: str | dict) -> dict[str, str]:
    """new_special_tokens_config: a mapping token -> description, inline or in a YAML / JSON file."""
    if isinstance(value, dict):
        data, where = value, DESCRIPTIONS_KEY
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"{DESCRIPTIONS_KEY}: {value} is not a file; give a YAML or JSON file mapping each new "
                              f"special token to its description (<think>: the start of the reasoning)",
                              key=DESCRIPTIONS_KEY)
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
            raise ConfigError(f"{DESCRIPTIONS_KEY}: cannot read {path}: {e}", key=DESCRIPTIONS_KEY) from None
        where = str(path)
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{DESCRIPTIONS_KEY}: {where} must map each new special token to its description "
                          f"(<think>: the start of the reasoning); got {type(data).__name__ if data else 'nothing'}",
                          key=DESCRIPTIONS_KEY)
    for token, text in data.items():
        if not isinstance(token, str) or not token.strip() or not isinstance(text, str):
            raise ConfigError(f"{DESCRIPTIONS_KEY}: {where}: {token!r}: {text!r} is not a token and a description "
                              f"(both text)", key=DESCRIPTIONS_KEY)
    return dict(data)


def check_new_tokens(cfg: RunConfig, fail: Callable[..., None]) -> None:
    m = cfg.model
    tokens = requested_tokens(m)
    if m.init_special_tokens not in INIT_METHODS:  # a RunConfig built in code skips the loader's choices check
        fail(f"init_special_tokens '{m.init_special_tokens}' is not one of {', '.join(INIT_METHODS)}",
             key="init_special_tokens")
    if m.init_special_tokens != "noise_init" and not tokens.descriptions:
        fail(f"init_special_tokens {m.init_special_tokens} starts each new special token from its description: set "
             f"new_special_tokens_config (token -> description), or use init_special_tokens: noise_init",
             key=("init_special_tokens", DESCRIPTIONS_KEY))
    if (tokens or m.resize_vocab) and m.quantization_bit is not None:
        fail(f"new tokens (or resize_vocab) grow the embeddings, which a {m.quantization_bit}-bit base cannot take; "
             f"drop quantization_bit (train lora on the unquantized base)",
             key=("quantization_bit", "resize_vocab" if m.resize_vocab and not tokens else "add_special_tokens"))
