"""What trains for each finetuning_type, LoRA / OFT options, continued adapters, tied embeddings."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import input_and_output_embeddings, loss_and_backward, trainable_names
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tuneforge.errors import ConfigError, ModelError
from tuneforge.model import load_model

LINEARS = {"self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}
LAYER_PARAMS = [f"{block}.{name}.weight" for block, names in LINEARS.items() for name in names] + [
    "input_layernorm.weight", "post_attention_layernorm.weight"]


def layer_params(idx: int) -> set[str]:
    return {f"model.layers.{idx}.{name}" for name in LAYER_PARAMS}


def lora_names(layers=(0, 1), modules=None) -> set[str]:
    modules = modules or [f"{b}.{n}" for b, names in LINEARS.items() for n in names]
    return {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.default.weight"
            for i in layers for m in modules for ab in "AB"}


def assert_tied(model) -> None:
    embed, head = input_and_output_embeddings(model)
    assert head.weight is embed.weight


# ---------------------------------------------------------------- full / freeze


def test_full_trains_everything_and_stays_tied(make_cfg, tmp_path):
    model = load_model(make_cfg(finetuning_type="full"))
    assert all(p.requires_grad for p in model.parameters())
    assert_tied(model)
    model.save_pretrained(tmp_path)
    assert_tied(AutoModelForCausalLM.from_pretrained(tmp_path))


def test_freeze_last_layer(make_cfg):
    model = load_model(make_cfg(finetuning_type="freeze", freeze_trainable_layers=1))
    assert trainable_names(model) == layer_params(1)
    assert_tied(model)


def test_freeze_first_layer(make_cfg):
    model = load_model(make_cfg(finetuning_type="freeze", freeze_trainable_layers=-1))
    assert trainable_names(model) == layer_params(0)


def test_freeze_named_modules_and_extras(make_cfg, batch):
    model = load_model(make_cfg(finetuning_type="freeze", freeze_trainable_layers=1,
                                freeze_trainable_modules="mlp,input_layernorm",
                                freeze_extra_modules="embed_tokens,norm"))
    assert trainable_names(model) == {
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight",
        "model.embed_tokens.weight", "model.norm.weight",
    }
    assert_tied(model)  # training embed_tokens trains the tied head with it
    loss_and_backward(model, batch)
    assert model.lm_head.weight.grad is model.model.embed_tokens.weight.grad


def test_freeze_unknown_module_lists_the_available_ones(make_cfg):
    with pytest.raises(ConfigError, match="'ffn' is not a module of a decoder layer; available: all, self_attn, "
                                          "mlp, input_layernorm, post_attention_layernorm"):
        load_model(make_cfg(finetuning_type="freeze", freeze_trainable_modules="ffn"))
    with pytest.raises(ConfigError, match="freeze_extra_modules: 'wte' .* available: embed_tokens, lm_head, norm"):
        load_model(make_cfg(finetuning_type="freeze", freeze_extra_modules="wte"))


def test_freeze_more_layers_than_the_model_has(make_cfg):
    with pytest.raises(ConfigError, match="the model has 2 layers; got 3"):
        load_model(make_cfg(finetuning_type="freeze", freeze_trainable_layers=3))


# ---------------------------------------------------------------- lora


def test_lora_all_targets_every_linear_but_the_head(make_cfg, tmp_path):
    model = load_model(make_cfg(finetuning_type="lora", lora_rank=4))
    assert isinstance(model, PeftModel)
    assert trainable_names(model) == lora_names()
    assert model.peft_config["default"].target_modules == {n for names in LINEARS.values() for n in names}
    assert not hasattr(model.get_base_model().lm_head, "lora_A")
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.lora_alpha["default"] == 8 and q_proj.scaling["default"] == 2.0  # alpha = 2r by default
    assert_tied(model)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file()


def test_lora_named_targets_alpha_dropout(make_cfg):
    model = load_model(make_cfg(finetuning_type="lora", lora_rank=4, lora_alpha=2, lora_dropout=0.25,
                                lora_target="q_proj,v_proj"))
    assert trainable_names(model) == lora_names(modules=["self_attn.q_proj", "self_attn.v_proj"])
    v_proj = model.get_base_model().model.layers[1].self_attn.v_proj
    assert v_proj.scaling["default"] == 0.5
    assert v_proj.lora_dropout["default"].p == 0.25


def test_rslora_scaling(make_cfg):
    model = load_model(make_cfg(finetuning_type="lora", lora_rank=4, use_rslora=True))
    scaling = model.get_base_model().model.layers[0].mlp.up_proj.scaling["default"]
    assert scaling == pytest.approx(8 / math.sqrt(4))


def test_unknown_lora_target_lists_the_linear_layers(make_cfg):
    with pytest.raises(ConfigError, match="lora_target: 'query' is not a linear layer of the model; available: "
                                          "all, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
                                          "lm_head"):
        load_model(make_cfg(finetuning_type="lora", lora_target="query"))


def test_dora_adds_magnitude_vectors(make_cfg):
    model = load_model(make_cfg(finetuning_type="lora", lora_rank=2, use_dora=True, lora_target="q_proj,down_proj"))
    magnitudes = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert len(magnitudes) == 4 and all(p.requires_grad for p in magnitudes.values())
    down = model.get_base_model().model.layers[0].mlp.down_proj
    # the magnitude starts as the weight's row norms
    torch.testing.assert_close(down.lora_magnitude_vector["default"].weight, down.base_layer.weight.norm(dim=1))
    assert trainable_names(model) == lora_names(modules=["self_attn.q_proj", "mlp.down_proj"]) | set(magnitudes)


@pytest.mark.parametrize("pissa_iter, init", [(-1, "pissa"), (4, "pissa_niter_4")])
def test_pissa_keeps_the_output_and_moves_the_base(make_cfg, tiny_model_dir, batch, pissa_iter, init):
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected = original(input_ids=batch).logits
    model = load_model(make_cfg(finetuning_type="lora", lora_rank=4, pissa_init=True, pissa_iter=pissa_iter))
    assert model.peft_config["default"].init_lora_weights == init
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    assert (logits - expected).abs().max() < 1e-4
    before = original.model.layers[0].self_attn.q_proj.weight
    after = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert (after - before).abs().max() > 1e-3  # the principal part moved into A and B


@pytest.mark.parametrize("dtype_key", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_resumed_pissa_run_rebuilds_the_same_residual_from_its_initial_adapter(make_cfg, tmp_path, dtype_key):
    keys = {"finetuning_type": "lora", "lora_rank": 4, "pissa_init": True, "pissa_iter": 2, **dtype_key}
    torch.manual_seed(0)
    first = load_model(make_cfg(**keys))
    out = tmp_path / "out"
    first.save_pretrained(out / "pissa_init")  # as the trainer does at the start of a run
    (out / "checkpoint-3").mkdir()
    torch.manual_seed(1)  # another randomized SVD would give another residual
    resumed = load_model(make_cfg(**keys, output_dir=str(out), resume_from_checkpoint=True))
    expected = first.state_dict()
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert expected[q_proj].dtype == (torch.bfloat16 if dtype_key else torch.float32)
    assert resumed.state_dict().keys() == expected.keys()
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, expected[name]), name  # bit for bit, bf16 residuals too
    assert resumed.peft_config["default"].init_lora_weights == "pissa_niter_2"
    torch.manual_seed(1)
    fresh = load_model(make_cfg(**keys))
    assert not torch.equal(fresh.state_dict()[q_proj], expected[q_proj])


def test_additional_target_embeddings_stay_tied_through_save_and_load(make_cfg, tmp_path, batch):
    model = load_model(make_cfg(finetuning_type="lora", lora_target="q_proj", additional_target="embed_tokens"))
    assert "base_model.model.model.embed_tokens.modules_to_save.default.weight" in trainable_names(model)
    assert_tied(model)
    with torch.no_grad():
        model.get_base_model().model.embed_tokens.weight.add_(0.5)  # as a training step would
    assert_tied(model)
    model.save_pretrained(tmp_path)
    reloaded = load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tmp_path)))
    assert_tied(reloaded)
    embed, _ = input_and_output_embeddings(reloaded)
    torch.testing.assert_close(embed.weight, model.get_base_model().model.embed_tokens.weight, rtol=0, atol=0)


# ---------------------------------------------------------------- oft


def test_oft_trains_only_oft_params(make_cfg, batch):
    model = load_model(make_cfg(finetuning_type="oft", oft_block_size=32, oft_rank=0))
    names = trainable_names(model)
    assert names and all(".oft_R." in n for n in names)
    assert len(names) == 14
    # one 32x32 block (32*31/2 = 496 free values) per 32 input features: 8 blocks per layer
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * 8 * 496
    assert_tied(model)
    loss_and_backward(model, batch)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == names


def test_oft_on_a_4bit_base(make_cfg, batch):
    model = load_model(make_cfg(finetuning_type="oft", oft_block_size=32, oft_rank=0, quantization_bit=4))
    assert torch.isfinite(loss_and_backward(model, batch))
    assert all(".oft_R." in n for n, p in model.named_parameters() if p.grad is not None)


# ---------------------------------------------------------------- continued adapters


def _saved_adapter(make_cfg, folder, seed: int, **keys) -> dict[str, torch.Tensor]:
    """Save a lora adapter with random (non-zero) B; return its weights as saved."""
    torch.manual_seed(seed)
    model = load_model(make_cfg(finetuning_type="lora", lora_rank=2, lora_target="q_proj", **keys))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.5)
    model.save_pretrained(folder)
    return load_file(folder / "adapter_model.safetensors")


def _lora_delta(saved: dict[str, torch.Tensor], layer: int, scaling: float) -> torch.Tensor:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return saved[f"{prefix}.lora_B.weight"] @ saved[f"{prefix}.lora_A.weight"] * scaling


def test_continue_an_adapter_loads_it_exactly_and_trains(make_cfg, tmp_path, batch):
    saved = _saved_adapter(make_cfg, tmp_path, seed=1)
    model = load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tmp_path), lora_rank=16))
    assert trainable_names(model) == lora_names(modules=["self_attn.q_proj"])
    weights = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    assert set(weights) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)
    assert model.get_base_model().model.layers[0].self_attn.q_proj.r["default"] == 2  # the adapter's own rank
    assert_tied(model)
    loss_and_backward(model, batch)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


def test_several_adapters_merge_all_but_the_last(make_cfg, tiny_model_dir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    saved_first = _saved_adapter(make_cfg, first, seed=1)
    saved_second = _saved_adapter(make_cfg, second, seed=2)
    base_q = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers[1].self_attn.q_proj.weight
    model = load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=f"{first},{second}"))
    q_proj = model.get_base_model().model.layers[1].self_attn.q_proj
    torch.testing.assert_close(q_proj.base_layer.weight, base_q + _lora_delta(saved_first, 1, 2.0))
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    torch.testing.assert_close(q_proj.lora_B["default"].weight, saved_second[key], rtol=0, atol=0)
    assert q_proj.lora_B["default"].weight.requires_grad


def test_create_new_adapter_merges_all_and_starts_fresh(make_cfg, tiny_model_dir, tmp_path):
    saved = _saved_adapter(make_cfg, tmp_path, seed=1)
    base_q = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers[0].self_attn.q_proj.weight
    model = load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tmp_path),
                                create_new_adapter=True, lora_rank=4, lora_target="v_proj"))
    base = model.get_base_model()
    torch.testing.assert_close(base.model.layers[0].self_attn.q_proj.weight, base_q + _lora_delta(saved, 0, 2.0))
    assert trainable_names(model) == lora_names(modules=["self_attn.v_proj"])
    assert base.model.layers[0].self_attn.v_proj.lora_B["default"].weight.abs().sum() == 0
    assert_tied(model)


def test_adapter_folder_without_adapter_config(make_cfg, tiny_model_dir):
    with pytest.raises(ModelError, match="has no adapter_config.json"):
        load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tiny_model_dir)))


def test_adapter_of_another_base_model(make_cfg, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1)
    get_peft_model(LlamaForCausalLM(other), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"does not fit this base model \(size mismatch .*set model_name_or_path"):
        load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tmp_path)))


def test_adapter_of_another_type(make_cfg, tmp_path):
    load_model(make_cfg(finetuning_type="oft", oft_target="q_proj")).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="is a OFT adapter but finetuning_type is lora"):
        load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tmp_path)))


def test_merging_into_a_quantized_base_is_refused(make_cfg, tmp_path):
    _saved_adapter(make_cfg, tmp_path, seed=1)
    with pytest.raises(ConfigError, match="merging adapters into a quantized base"):
        load_model(make_cfg(finetuning_type="lora", adapter_name_or_path=str(tmp_path), create_new_adapter=True,
                            quantization_bit=4))
