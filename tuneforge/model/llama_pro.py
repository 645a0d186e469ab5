"""LLaMA Pro (Wu et al. 2024): block expansion. `tuneforge llama-pro MODEL OUTPUT --num-expand N` inserts N copies of
decoder blocks, one after every (layers / N) original blocks, each with its output projections (attention and MLP)
zeroed: a block that adds nothing to the residual stream, so the expanded model computes exactly what the original
did. Training with `use_llama_pro: true` then trains only those new blocks (freeze: the whole blocks; lora / oft:
adapters on them only), `freeze_trainable_layers` being N, as LlamaFactory reads it.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from tuneforge.atomic import atomic_folder
from tuneforge.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)

# the modules that write a block's attention and MLP results into the residual stream, by family: Llama / Qwen /
# Mistral / Gemma (o_proj, down_proj; an MoE's experts and shared expert too), Phi (dense, fc2), GPT-2 style (c_proj)
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "dense", "fc2", "c_proj", "out_proj", "w2", "wo")


def expanded_layer_ids(num_layers: int, num_expand: int) -> list[int]:
    """The indices of the inserted blocks in a model expanded to num_layers: the last of each group of
    num_layers / num_expand."""
    if num_expand <= 0 or num_layers % num_expand:
        raise ConfigError(f"use_llama_pro: freeze_trainable_layers ({num_expand}) must be the number of expanded "
                          f"blocks, a positive divisor of the model's {num_layers} layers",
                          key=("use_llama_pro", "freeze_trainable_layers"))
    stride = num_layers // num_expand
    return list(range(stride - 1, num_layers, stride))


def zero_block_outputs(block: nn.Module) -> list[str]:
    """Zero the output projections of a decoder block in place; the names of the tensors zeroed."""
    zeroed = []
    for name, param in block.named_parameters():
        if any(part in OUTPUT_PROJECTIONS for part in name.split(".")):
            with torch.no_grad():
                param.zero_()
            zeroed.append(name)
    return zeroed


def expand_blocks(model: nn.Module, num_expand: int) -> list[int]:
    """Insert the zero-output copies into model (in place) and update its config; the source block of every block."""
    from tuneforge.model.adapters import decoder_layers

    path, layers = decoder_layers(model)
    count = len(layers)
    if num_expand <= 0 or count % num_expand:
        raise ConfigError(f"--num-expand ({num_expand}) must be a positive divisor of the model's {count} layers")
    split = count // num_expand
    blocks: list[nn.Module] = []
    origin: list[int] = []
    for i, layer in enumerate(layers):
        blocks.append(layer)
        origin.append(i)
        if (i + 1) % split == 0:
            new = copy.deepcopy(layer)
            if not zero_block_outputs(new):
                raise ModelError(f"cannot expand {type(model).__name__}: its decoder blocks have none of the output "
                                 f"projections {', '.join(OUTPUT_PROJECTIONS)}")
            blocks.append(new)
            origin.append(i)
    parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
    setattr(parent, path.rsplit(".", 1)[-1], nn.ModuleList(blocks))
    for index, block in enumerate(blocks):  # the KV cache finds a block's entries by its index
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key, value in list(vars(config).items()):  # per-layer settings (layer_types, ...) follow their block
        if isinstance(value, list) and len(value) == count and key != "num_hidden_layers":
            setattr(config, key, [value[o] for o in origin])
    config.num_hidden_layers = len(blocks)
    return origin


def expand_model(source: str, output: Path, num_expand: int, *, trust_remote_code: bool = False) -> dict:
    """Expand the model in folder `source` into `output` (written whole or not at all), checking that the saved
    model's logits on a probe equal the original's. Returns what it did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"{output} exists and is not empty; choose a new folder for the expanded model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load the model in {source}: {e}") from None
    model.eval()
    probe = torch.arange(3, 19)[None] % model.config.get_text_config().vocab_size
    with torch.no_grad():
        before = model(input_ids=probe).logits.float()
    layers = model.config.get_text_config().num_hidden_layers
    origin = expand_blocks(model, num_expand)
    with atomic_folder(output) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype="auto", trust_remote_code=trust_remote_code)
        with torch.no_grad():
            after = reloaded.eval()(input_ids=probe).logits.float()
        difference = float((after - before).abs().max())
        if not torch.allclose(after, before, rtol=0.0, atol=1e-5):
            raise ModelError(f"the expanded {type(model).__name__} does not compute what the original did (logits "
                             f"differ by up to {difference:.3g}); this family cannot be expanded by zeroing "
                             f"{', '.join(OUTPUT_PROJECTIONS)}")
    new = [i for i in range(len(origin)) if i in expanded_layer_ids(len(origin), num_expand)]
    logger.info("expanded %d layers to %d (new blocks %s); train it with finetuning_type: freeze, "
                "freeze_trainable_layers: %d, use_llama_pro: true", layers, len(origin), new, num_expand)
    return {"layers": layers, "expanded_layers": len(origin), "new_blocks": new, "max_logit_difference": difference,
            "output": str(output)}
