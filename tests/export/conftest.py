"""Fixtures for the export tests: a LoRA adapter with non-zero B on the tiny model, configs, an rm adapter."""

from __future__ import annotations

import shutil

import pytest
import torch

from tuneforge.config import from_dict


def _lora(model, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so the adapter changes the logits
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


@pytest.fixture(scope="session")
def lora_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("lora")
    _lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=1).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def rm_lora_dir(tiny_model_dir, tmp_path_factory):
    """An rm output folder: a LoRA adapter plus value_head.safetensors."""
    from transformers import AutoModelForCausalLM

    from tuneforge.model.value_head import ValueHeadModel

    out = tmp_path_factory.mktemp("rm-lora")
    model = ValueHeadModel(_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=2))
    torch.nn.init.normal_(model.v_head.bias)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def eos_differs_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with eos `<|endoftext|>`, so eos and SmolLM2's end of turn `<|im_end|>` differ."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-eos")
    for path in tiny_model_dir.iterdir():
        shutil.copy(path, out / path.name)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def make_cfg(tiny_model_dir, lora_dir, tmp_path):
    """make_cfg(key=value, ...): the tiny model + lora_dir, exported to tmp_path/out unless told otherwise."""

    def build(**keys):
        raw = {"model_name_or_path": str(tiny_model_dir), "adapter_name_or_path": str(lora_dir),
               "export_dir": str(tmp_path / "out"), **keys}
        return from_dict({k: v for k, v in raw.items() if v is not None}, for_training=False)

    return build


@pytest.fixture
def input_ids():
    return torch.randint(3, 49152, (2, 12), generator=torch.Generator().manual_seed(0))



@pytest.fixture(scope="session")
def small_vocab_dir(tmp_path_factory, tokenizer):
    """A tiny Llama with a 322-token byte-level BPE tokenizer (embeddings padded to 336 rows) and SmolLM2's
    chat template: GGUF files of the 49k-token tokenizer take transformers ~10 s per load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=322, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello world, it's a test!"] * 8, trainer)
    small = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                    pad_token="<|im_end|>", unk_token="<|endoftext|>")
    small.chat_template = tokenizer.chat_template
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=336, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=50000.0, tie_word_embeddings=False, bos_token_id=small.bos_token_id,
                         eos_token_id=small.eos_token_id, pad_token_id=small.pad_token_id)
    out = tmp_path_factory.mktemp("small-vocab")
    LlamaForCausalLM(config).save_pretrained(out)
    small.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def small_lora_dir(small_vocab_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("small-lora")
    _lora(AutoModelForCausalLM.from_pretrained(small_vocab_dir), seed=3).save_pretrained(out)
    return out
