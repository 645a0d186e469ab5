"""rope_scaling: the loaded model is transformers' own model built with the scaled rope, the saved config carries it,
inference applies it to an adapter's base, and bad values are clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from tuneforge.errors import ConfigError
from tuneforge.model import load_model
from tuneforge.model.inference import load_inference_model
from tuneforge.model.rope import apply_rope_scaling

PRETRAINED = 512  # the tiny model's max_position_embeddings


def reference(tiny_model_dir, rope_parameters, max_positions):
    """transformers' own model on the tiny weights, its config given these rope parameters directly."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **rope_parameters}
    config.max_position_embeddings = max_positions
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config).eval()


def logits(model, length=1300):
    ids = torch.arange(3, 3 + length)[None] % 2000
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(length)[None]).logits


@pytest.mark.parametrize(("rope_type", "expected", "positions"), [
    ("linear", {"rope_type": "linear", "factor": 3.0}, 1536),
    ("dynamic", {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": PRETRAINED}, PRETRAINED),
    ("yarn", {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": PRETRAINED}, 1536),
    ("llama3", {"rope_type": "llama3", "factor": 3.0, "original_max_position_embeddings": PRETRAINED,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 1536),
])
def test_scaled_model_is_transformers_model_with_that_rope(make_cfg, tiny_model_dir, tmp_path, rope_type, expected,
                                                            positions):
    # cutoff_len 1300 over 512 pretrained positions: factor ceil(1300 / 512) = 3, as LlamaFactory derives it
    model = load_model(make_cfg(rope_scaling=rope_type, cutoff_len=1300, finetuning_type="full",
                                disable_gradient_checkpointing=True), device="cpu").eval()
    assert {k: model.config.rope_parameters[k] for k in expected} == expected
    assert model.config.max_position_embeddings == positions
    ours, theirs = logits(model), logits(reference(tiny_model_dir, expected, positions))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.allclose(ours, logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()))

    model.save_pretrained(tmp_path)  # what a full run saves: plain transformers reloads the same scaled model
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    torch.testing.assert_close(logits(reloaded), ours, rtol=0, atol=0)


def test_model_max_length_overrides_cutoff_len_and_a_length_that_fits_scales_nothing(make_cfg):
    config = load_model(make_cfg(rope_scaling="linear", cutoff_len=64, model_max_length=2048), device="cpu").config
    assert config.rope_parameters["factor"] == 4.0 and config.max_position_embeddings == 2048
    config = load_model(make_cfg(rope_scaling="linear", cutoff_len=512), device="cpu").config
    assert config.rope_parameters["rope_type"] == "default" and config.max_position_embeddings == PRETRAINED


def test_an_adapter_is_served_on_the_base_it_was_trained_with(make_cfg, tmp_path):
    cfg = make_cfg(rope_scaling="yarn", cutoff_len=1024)
    trained = load_model(cfg, device="cpu")
    with torch.no_grad():
        next(p for n, p in trained.named_parameters() if "lora_B" in n).add_(0.5)
    trained.save_pretrained(tmp_path)
    served = load_inference_model(make_cfg(rope_scaling="yarn", cutoff_len=1024, adapter_name_or_path=[str(tmp_path)]),
                                  device="cpu")
    assert served.config.rope_parameters["rope_type"] == "yarn" and served.config.rope_parameters["factor"] == 2.0
    torch.testing.assert_close(logits(served, 900), logits(trained.eval(), 900))


def test_a_model_without_rope_is_a_clear_error():
    with pytest.raises(ConfigError, match="gpt2 models have no rotary position embeddings") as e:
        apply_rope_scaling(GPT2Config(), "linear", 4096)
    assert e.value.key == "rope_scaling"


def test_an_unknown_type_is_refused_when_the_file_loads(make_cfg):
    with pytest.raises(ConfigError, match="rope_scaling"):
        make_cfg(rope_scaling="ntk")
    with pytest.raises(ConfigError, match="'ntk' is not one of linear, dynamic, yarn, llama3"):
        apply_rope_scaling(AutoConfig.for_model("llama"), "ntk", 4096)
