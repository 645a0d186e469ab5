"""tuneforge/train/fsdp.py without a process group: which modules become units, and evaluation batches that give
every rank the same number of forwards. (Sharded training itself runs in tests/test_fsdp.py, 2 processes.)"""

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.config.fsdp import FsdpSettings
from tuneforge.errors import ConfigError
from tuneforge.train.fsdp import layers_to_shard
from tuneforge.train.trainer import eval_batches


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config)


def test_the_decoder_layers_are_the_default_units(llama):
    layers = layers_to_shard(llama, FsdpSettings())
    assert layers == list(llama.model.layers)


def test_named_classes_and_no_wrap(llama):
    norms = layers_to_shard(llama, FsdpSettings(layer_classes=("LlamaRMSNorm",)))
    assert len(norms) == 3 * 2 + 1 and all(type(m).__name__ == "LlamaRMSNorm" for m in norms)
    assert layers_to_shard(llama, FsdpSettings(wrap_layers=False)) == []
    with pytest.raises(ConfigError, match="no module of class GPT2Block.*it has: LlamaDecoderLayer"):
        layers_to_shard(llama, FsdpSettings(layer_classes=("GPT2Block",)))


def test_a_peft_model_finds_the_base_models_layers(llama):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(LlamaForCausalLM(llama.config), LoraConfig(r=2, target_modules=["q_proj"]))
    assert [type(m).__name__ for m in layers_to_shard(model, FsdpSettings())] == ["LlamaDecoderLayer"] * 3


@pytest.mark.parametrize(("rows", "size", "world"), [(17, 8, 2), (5, 2, 2), (1, 4, 2), (9, 2, 3), (8, 4, 2)])
def test_eval_batches_give_every_rank_the_same_number_of_forwards(rows, size, world):
    per_rank = [eval_batches(rows, size, rank, world, same_count=True) for rank in range(world)]
    assert len({len(batches) for batches in per_rank}) == 1
    counted = sorted(i for batches in per_rank for indices, kept in batches if kept for i in indices)
    assert counted == list(range(rows))  # each row counted once, on one rank
    assert all(len(indices) <= size and indices for batches in per_rank for indices, _ in batches)


def test_eval_batches_of_one_rank_are_the_unsharded_split():
    assert eval_batches(5, 2, 0, 1, same_count=True) == [([0, 1], True), ([2, 3], True), ([4], True)]
    assert eval_batches(17, 8, 1, 2, same_count=True)[-1] == ([1, 3, 5, 7, 9, 11, 13, 15], False)  # then a repeat
    assert eval_batches(17, 8, 1, 2) == [([1, 3, 5, 7, 9, 11, 13, 15], True)]  # DDP: each rank its own rows only
