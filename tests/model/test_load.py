"""load_tokenizer / load_model: dtype, attention, quantization, gradient checkpointing, errors, the built-in."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from model_helpers import loss_and_backward, trainable_names

from tuneforge.config import from_dict
from tuneforge.errors import ModelError
from tuneforge.model import describe_trainable, load_model, load_tokenizer
from tuneforge.model.load import attention_implementation

# ---------------------------------------------------------------- tokenizer


def test_tokenizer_pads_right_with_eos(make_cfg):
    tokenizer = load_tokenizer(make_cfg().model)
    assert tokenizer.padding_side == "right"
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.pad_token_id == 2


def test_tokenizer_without_pad_token_gets_eos(tmp_path, tiny_model_dir, tokenizer):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    no_pad = type(tokenizer).from_pretrained(tiny_model_dir)
    no_pad.pad_token = None
    no_pad.padding_side = "left"
    no_pad.save_pretrained(tmp_path)
    assert type(tokenizer).from_pretrained(tmp_path).pad_token is None  # the folder really lacks one
    loaded = load_tokenizer(from_dict({"model_name_or_path": str(tmp_path)}, for_training=False).model)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert loaded.padding_side == "right"


# ---------------------------------------------------------------- dtype


def test_default_is_fp32(make_cfg):
    model = load_model(make_cfg(), device=torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bf16_lora_keeps_base_bf16_and_adapter_fp32(make_cfg, batch):
    model = load_model(make_cfg(bf16=True))
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.base_layer.weight.dtype == torch.bfloat16
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    loss = loss_and_backward(model, batch, torch.bfloat16)
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)


def test_bf16_freeze_upcasts_only_the_trained_layer(make_cfg, batch):
    model = load_model(make_cfg(bf16=True, finetuning_type="freeze", freeze_trainable_layers=1))
    for name, param in model.named_parameters():
        expected = torch.float32 if name.startswith("model.layers.1.") else torch.bfloat16
        assert param.dtype == expected, name
    assert torch.isfinite(loss_and_backward(model, batch, torch.bfloat16))


def test_bf16_full_trains_everything_in_fp32(make_cfg):
    model = load_model(make_cfg(bf16=True, finetuning_type="full"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_fp16_base(make_cfg):
    model = load_model(make_cfg(fp16=True, lora_target="q_proj"))
    assert model.get_base_model().model.layers[1].mlp.up_proj.weight.dtype == torch.float16


# ---------------------------------------------------------------- attention, cache, checkpointing


@pytest.mark.parametrize("flash_attn, expected", [("auto", "sdpa"), ("sdpa", "sdpa"), ("eager", "eager"),
                                                  ("disabled", "eager")])
def test_attention_implementation(make_cfg, flash_attn, expected):
    # padding_free (on by default) swaps sdpa for its per-sequence form: tests/model/test_attention.py
    model = load_model(make_cfg(flash_attn=flash_attn, finetuning_type="freeze", freeze_trainable_layers=1,
                                padding_free=False))
    assert model.config._attn_implementation == expected
    assert model.config.use_cache is False


def test_fa2_maps_to_flash_attention_2():
    assert attention_implementation("fa2") == "flash_attention_2"


def _forward_calls_of_first_mlp(model, batch) -> int:
    calls = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # a pre-hook: the recompute stops early, right after the last saved tensor, before forward hooks
    hook = base.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
    loss_and_backward(model, batch)
    hook.remove()
    return len(calls)


def test_gradient_checkpointing_recomputes_and_gives_the_same_grads(make_cfg, batch):
    grads = {}
    for disabled in (False, True):
        model = load_model(make_cfg(finetuning_type="full", disable_gradient_checkpointing=disabled))
        assert model.training
        assert model.is_activation_checkpointing is (not disabled)
        # a checkpointed layer runs its forward again during backward
        assert _forward_calls_of_first_mlp(model, batch) == (1 if disabled else 2)
        grads[disabled] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in grads[True].items():
        torch.testing.assert_close(grads[False][name], grad, rtol=1e-5, atol=1e-7)


def test_checkpointing_with_lora_and_frozen_embeddings_still_backpropagates(make_cfg, batch):
    grads = {}
    for disabled in (False, True):
        torch.manual_seed(0)  # the same lora_A initialization both times
        model = load_model(make_cfg(finetuning_type="lora", disable_gradient_checkpointing=disabled))
        assert model.get_base_model().is_activation_checkpointing is (not disabled)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if ".lora_B." in name:  # B starts at zero, which would leave A without a gradient
                param.data.normal_(std=0.1)
        assert _forward_calls_of_first_mlp(model, batch) == (1 if disabled else 2)
        grads[disabled] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads[False]) == 28  # lora_A and lora_B on 7 linear layers x 2 decoder layers
    for name, grad in grads[True].items():
        assert grads[False][name].abs().sum() > 0, name
        torch.testing.assert_close(grads[False][name], grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- quantization


def test_qlora_4bit_nf4_double_quant(make_cfg, batch):
    import bitsandbytes as bnb

    model = load_model(make_cfg(quantization_bit=4, quantization_type="nf4", double_quantization=True))
    base = model.get_base_model()
    quantized = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14  # 7 linear layers x 2 decoder layers; the tied head stays unquantized
    state = quantized[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested is True
    assert quantized[0].compute_dtype == torch.float32
    assert describe_trainable(model).endswith("all params: 1,599,648 || trainable%: 0.5121")
    loss = loss_and_backward(model, batch)
    assert torch.isfinite(loss)
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == trainable_names(model)
    assert with_grad and all(".lora_A." in n or ".lora_B." in n for n in with_grad)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_qlora_4bit_bf16_compute_dtype_and_fp32_norms(make_cfg):
    import bitsandbytes as bnb

    model = load_model(make_cfg(quantization_bit=4, quantization_type="fp4", bf16=True))
    layer = model.get_base_model().model.layers[0]
    assert isinstance(layer.mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    assert layer.mlp.down_proj.base_layer.compute_dtype == torch.bfloat16
    assert layer.mlp.down_proj.base_layer.weight.quant_state.quant_type == "fp4"
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16


def test_qlora_8bit(make_cfg, batch):
    import bitsandbytes as bnb

    model = load_model(make_cfg(quantization_bit=8))
    assert isinstance(model.get_base_model().model.layers[1].self_attn.v_proj.base_layer, bnb.nn.Linear8bitLt)
    assert torch.isfinite(loss_and_backward(model, batch))
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == trainable_names(model)
    assert with_grad and all(".lora_A." in n or ".lora_B." in n for n in with_grad)


# ---------------------------------------------------------------- summary and log


def test_describe_trainable_counts_by_hand(make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="tuneforge.model"):
        model = load_model(make_cfg(finetuning_type="freeze", freeze_trainable_layers=1))
    # one layer: q,o 32x32; k,v 16x32; gate,up,down 64x32; two norms of 32 -> 9,280
    # all: embeddings 49152x32 (tied head counted once) + 2 layers + final norm 32 -> 1,591,456
    summary = describe_trainable(model)
    assert summary == "trainable params: 9,280 || all params: 1,591,456 || trainable%: 0.5831"
    assert summary in caplog.text
    assert "attention sdpa" in caplog.text and "finetuning freeze" in caplog.text
    assert str(make_cfg().model.model_name_or_path) in caplog.text


# ---------------------------------------------------------------- errors


def test_folder_without_config_json(tmp_path):
    cfg = from_dict({"model_name_or_path": str(tmp_path), "finetuning_type": "full"}, for_training=False)
    with pytest.raises(ModelError, match="has no config.json"):
        load_model(cfg)


def test_folder_without_weights(tmp_path, tiny_model_dir):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    cfg = from_dict({"model_name_or_path": str(tmp_path), "finetuning_type": "full"}, for_training=False)
    with pytest.raises(ModelError, match="has no model weights"):
        load_model(cfg)


def test_custom_code_needs_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "tuneforge-custom",
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomModel"},
    }))
    (tmp_path / "configuration_custom.py").write_text("raise RuntimeError('must not run')\n")
    cfg = from_dict({"model_name_or_path": str(tmp_path)}, for_training=False)
    with pytest.raises(ModelError, match="custom model code .* set trust_remote_code: true"):
        load_model(cfg)


# ---------------------------------------------------------------- the built-in model


def test_builtin_model_lora_trainable_count():
    cfg = from_dict({"model_name_or_path": "smollm2-135m-instruct", "lora_rank": 8,
                     "disable_gradient_checkpointing": True}, for_training=False)
    tokenizer = load_tokenizer(cfg.model)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2 and len(tokenizer) == 49152
    model = load_model(cfg, device=torch.device("cpu"))
    hidden, inter, layers, kv = 576, 1536, 30, 3 * 64
    # LoRA adds r x (in + out) per linear layer
    per_layer = 8 * ((hidden + hidden) * 2 + (hidden + kv) * 2 + (hidden + inter) * 3)
    assert per_layer == 81_408
    base = 49152 * hidden + layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden) + hidden
    trainable, total = layers * per_layer, base + layers * per_layer
    share = 100 * trainable / total
    assert describe_trainable(model) == (
        f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}")
    assert trainable == 2_442_240 and base == 134_515_008
