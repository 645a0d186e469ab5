"""New tokens: into the tokenizer, into the model (embeddings and head grown, the new rows initialised), and into
what trains.

The tokenizer gets the config's tokens (add_tokens plain, add_special_tokens / new_special_tokens_config special)
and, first, the tokens a saved adapter's tokenizer carries beyond it, so that chat / export / a continued run of an
adapter trained with new tokens number them as training did. The embeddings grow to exactly len(tokenizer) (what
peft's AutoPeftModel and `resize_token_embeddings(len(tokenizer))` reload), and the new rows start as
init_special_tokens says (LlamaFactory's strategies), drawn from a generator seeded with the run's seed: the
policy, its reference and a resumed run start from the same rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tuneforge.config.new_tokens import requested_tokens
from tuneforge.errors import ConfigError, ModelError
from tuneforge.model.hub import resolve_adapter

if TYPE_CHECKING:
    from tuneforge.config import ModelArgs, RunConfig

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def adapter_tokenizer_folders(model_args: ModelArgs) -> list[Path]:
    """The adapter folders (adapter_name_or_path) that hold a saved tokenizer."""
    m = model_args
    folders = [resolve_adapter(a, cache_dir=m.cache_dir, revision=m.model_revision, token=m.hf_hub_token)
               for a in m.adapter_name_or_path or []]
    return [f for f in folders if any((f / name).is_file() for name in TOKENIZER_FILES)]


def wants_new_tokens(model_args: ModelArgs) -> bool:
    """Whether loading this config's model may change its vocabulary (new tokens, resize_vocab, or adapters that
    saved a tokenizer)."""
    return bool(model_args.resize_vocab or requested_tokens(model_args) or adapter_tokenizer_folders(model_args))


def add_new_tokens(tokenizer: Any, model_args: ModelArgs, *, quiet: bool = False) -> list[int]:
    """Add the saved adapters' extra tokens, then the config's new tokens, to tokenizer (in place); returns the ids
    of the config's tokens that were new (the rows init_special_tokens initialises). A token the tokenizer already
    has is left as it is (LlamaFactory's tokenizer skips it too): the data keeps its tokenization, the model its row.
    quiet: say nothing (the tokenizer was loaded, and this said, before)."""
    log = logger.debug if quiet else logger.info
    for folder in adapter_tokenizer_folders(model_args):
        _adopt_saved_tokens(tokenizer, folder)
    tokens = requested_tokens(model_args)
    new_ids: list[int] = []
    for special, group in ((False, tokens.plain), (True, tokens.special)):
        vocab = tokenizer.get_vocab()
        known = [t for t in group if t in vocab]
        fresh = [t for t in group if t not in vocab]
        # in the model's own vocabulary (an added token is most likely this run's own, saved and loaded back)
        base = [t for t in known if t not in tokenizer.added_tokens_encoder]
        if base and not quiet:
            logger.warning("%s already in the vocabulary (ids %s): not added, kept as they are",
                           ", ".join(base), ", ".join(str(vocab[t]) for t in base))
        if fresh:
            tokenizer.add_tokens(fresh, special_tokens=special)
            new_ids += tokenizer.convert_tokens_to_ids(fresh)
            log("added %s tokens %s (ids %s)", "special" if special else "plain", ", ".join(fresh),
                ", ".join(map(str, new_ids[-len(fresh):])))
    return new_ids


def _adopt_saved_tokens(tokenizer: Any, folder: Path) -> None:
    """The added tokens of folder's tokenizer that tokenizer lacks, at the same ids (or a ModelError)."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    for token_id, token in sorted(saved.added_tokens_decoder.items()):
        if token.content in vocab:
            continue
        tokenizer.add_tokens([token])  # an AddedToken keeps its special flag and stripping rules
        got = tokenizer.convert_tokens_to_ids(token.content)
        if got != token_id:
            raise ModelError(f"the tokenizer saved in {folder} numbers {token.content!r} {token_id}, but added to the "
                             f"base model's tokenizer it gets {got}: the adapter was trained on another base; set "
                             f"model_name_or_path to that model")
        vocab[token.content] = got
        logger.info("%s: token %r (id %d) from the adapter's tokenizer", folder, token.content, got)


@torch.no_grad()
def fit_embeddings(model: nn.Module, tokenizer: Any, new_ids: list[int], model_args: ModelArgs, seed: int) -> bool:
    """Grow the input embeddings (and an untied head) to len(tokenizer) when smaller, and initialise the rows of
    new_ids and of any grown row. Returns whether the embeddings should train (resize_vocab, or new rows)."""
    embed = model.get_input_embeddings()
    rows, wanted = embed.weight.shape[0], len(tokenizer)
    init_ids = sorted(set(new_ids) | set(range(rows, wanted)))
    if wanted > rows:
        head = model.get_output_embeddings()
        if getattr(model, "hf_quantizer", None) is not None:
            raise ModelError(f"the model is quantized, and its embeddings cannot grow to the {wanted - rows} new "
                             f"token(s); load the unquantized model")
        if head is not None and not isinstance(head, nn.Linear):
            raise ModelError(f"{type(model).__name__}'s output layer ({type(head).__name__}) cannot be resized to "
                             f"new tokens; drop add_tokens / add_special_tokens")
        # (the text config's vocab_size follows); our own initialisation of the new rows comes next
        model.resize_token_embeddings(wanted, mean_resizing=False)
        logger.info("embeddings resized from %d to %d rows", rows, wanted)
    if init_ids:
        _initialise(model, tokenizer, init_ids, model_args, seed)
    return bool(model_args.resize_vocab or init_ids)


def _initialise(model: nn.Module, tokenizer: Any, ids: list[int], model_args: ModelArgs, seed: int) -> None:
    weights = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not weights[0]:
        weights.append(head.weight)
    new = set(ids)
    known = sorted(i for i in tokenizer.get_vocab().values() if i not in new and i < weights[0].shape[0])
    descriptions = _description_ids(tokenizer, requested_tokens(model_args).descriptions, new, known)
    method = model_args.init_special_tokens
    for weight in weights:  # the same noise for the head as for the embeddings, as both start from one seed
        generator = torch.Generator().manual_seed(seed)
        values = init_rows(weight, ids, known, method, descriptions, generator)
        weight[ids] = values.to(device=weight.device, dtype=weight.dtype)
    logger.info("initialised %d new token row(s) with %s", len(ids), method)


def _description_ids(tokenizer: Any, descriptions: dict[str, str], new: set[int], known: list[int]) -> dict[int, list[int]]:
    """token id -> the ids of its description's tokens that already have a trained row."""
    out, have = {}, set(known)
    for token, text in descriptions.items():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id not in new:
            continue  # already in the vocabulary: not initialised
        ids = [i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i in have]
        if not ids:
            logger.warning("the description of %s has no token with a trained row; it starts from the mean row", token)
        out[token_id] = ids
    return out


def init_rows(weight: torch.Tensor, ids: list[int], known: list[int], method: str,
              descriptions: dict[int, list[int]], generator: torch.Generator) -> torch.Tensor:
    """The starting rows (fp32, on the CPU) of the tokens `ids` in an embedding / head matrix `weight`.

    noise_init: the mean of the known rows + N(0, 1/d) noise (std 1/sqrt(d), d the row width), as LlamaFactory.
    desc_init: the mean of the rows of the token's description tokens (tokens without one: noise_init).
    desc_init_w_noise: that + the same noise. A head's rows come from the head's own rows of those tokens.
    """
    matrix = weight.detach().float().cpu()
    d = matrix.shape[1]
    mean = matrix[known].mean(dim=0)
    noise = torch.randn(len(ids), d, generator=generator) / math.sqrt(d)
    rows = mean + noise
    if method == "noise_init":
        return rows
    if method not in ("desc_init", "desc_init_w_noise"):
        raise ConfigError(f"init_special_tokens '{method}' is not one of noise_init, desc_init, desc_init_w_noise",
                          key="init_special_tokens")
    for k, token_id in enumerate(ids):
        if token_id not in descriptions:
            continue
        source = descriptions[token_id]
        start = matrix[source].mean(dim=0) if source else mean
        rows[k] = start + noise[k] if method == "desc_init_w_noise" else start
    return rows


def embedding_names(model: nn.Module) -> list[str]:
    """The short names of the input embedding and, when not tied to it, the output head."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    wanted = [embed] + ([head] if head is not None and head.weight is not embed.weight else [])
    names = []
    for module in wanted:
        path = next(path for path, m in model.named_modules() if m is module)
        names.append(path.rsplit(".", 1)[-1])
    return names


def train_embeddings(cfg: RunConfig, model: nn.Module) -> RunConfig:
    """cfg with the embeddings (and an untied head) trained beside what it trains: modules_to_save of lora / oft
    (additional_target, as LlamaFactory adds them when the vocabulary is resized), freeze_extra_modules of freeze.
    full trains them anyway."""
    me = cfg.method
    names = embedding_names(model)
    if me.finetuning_type in ("lora", "oft"):
        if me.finetuning_type == "oft" and len(names) == 1 and getattr(model.config, "tie_word_embeddings", False):
            raise ConfigError("new tokens with finetuning_type oft: this model ties its head to its embeddings, and "
                              "peft's OFT cannot train the two as one; use finetuning_type lora or full",
                              key="finetuning_type")
        targets = list(dict.fromkeys([*(me.additional_target or []), *names]))
        logger.info("new tokens: %s train in full beside the adapter (saved with it)", ", ".join(names))
        return replace(cfg, method=replace(me, additional_target=targets))
    if me.finetuning_type == "freeze":
        extra = list(dict.fromkeys([*(me.freeze_extra_modules or []), *names]))
        logger.info("new tokens: %s train beside the unfrozen layers", ", ".join(names))
        return replace(cfg, method=replace(me, freeze_extra_modules=extra))
    return cfg

