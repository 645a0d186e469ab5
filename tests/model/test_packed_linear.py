"""Linear layers packed for generation on a CPU: the same numbers up to rounding, the dense weights freed, and
left alone wherever packing does not apply."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from tuneforge.errors import TuneforgeError
from tuneforge.model import packed_linear
from tuneforge.model.packed_linear import PackedLinear, pack_for_generation, packed_while_generating

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def tiny(tiny_model_dir, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval().requires_grad_(False)


def test_packed_layer_matches_linear_with_and_without_bias():
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(48, 40, bias=bias)
        packed = PackedLinear(linear.weight, linear.bias)
        for shape in ((1, 48), (4, 48), (2, 3, 48), (0, 48)):  # a decode step, a batch, a prefill, nothing
            x = torch.randn(shape)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        assert (packed.bias is not None) == bias


def test_every_decoder_linear_and_the_head_are_packed_and_the_logits_agree(tiny_model_dir, batch):
    dense, model = tiny(tiny_model_dir), tiny(tiny_model_dir)
    weights_before = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    assert pack_for_generation(model) == 7 * layers + 1  # q k v o gate up down in each layer, and the head
    assert not any(type(m) is nn.Linear for m in model.modules())
    hidden, inter, kv = model.config.hidden_size, model.config.intermediate_size, 2 * 8  # 2 kv heads of 8
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    # the dense weights are gone (the head's is the input embeddings', tied: that one stays)
    assert sum(p.numel() for p in model.parameters()) == weights_before - layers * per_layer
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(batch).logits, dense(batch).logits, rtol=1e-4, atol=1e-5)


def test_generation_writes_the_same_greedy_tokens(tiny_model_dir, batch):
    dense, model = tiny(tiny_model_dir), tiny(tiny_model_dir)
    pack_for_generation(model)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0  # a left-padded row
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "min_new_tokens": 12,
              "output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        want, got = dense.generate(batch, **kwargs), model.generate(batch, **kwargs)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-4, atol=1e-5)
    assert torch.equal(got.sequences, want.sequences)


def test_a_packed_layer_refuses_gradients():
    packed = PackedLinear(nn.Linear(8, 4).weight)
    with pytest.raises(RuntimeError, match="generation only"):
        packed(torch.randn(2, 8, requires_grad=True))


def test_left_alone_where_it_does_not_apply(tiny_model_dir, monkeypatch):
    assert pack_for_generation(tiny(tiny_model_dir, torch.bfloat16)) == 0  # only fp32
    lora = get_peft_model(tiny(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    assert pack_for_generation(lora) == 0  # unmerged adapters
    assert pack_for_generation(lora.merge_and_unload()) == 7 * 2 + 1  # merged, as load_inference_model merges
    state = torch.random.get_rng_state()
    assert pack_for_generation(tiny(tiny_model_dir)) > 0
    assert torch.equal(torch.random.get_rng_state(), state)  # a seeded run samples what it did before
    monkeypatch.setenv(packed_linear.ENV, "0")
    model = tiny(tiny_model_dir)
    assert pack_for_generation(model) == 0
    assert sum(type(m) is nn.Linear for m in model.modules()) == 7 * model.config.num_hidden_layers + 1
    monkeypatch.setenv(packed_linear.ENV, "disable")
    with pytest.raises(TuneforgeError, match="TUNEFORGE_PACKED_LINEAR='disable' is not on or off"):
        pack_for_generation(model)


def test_subclasses_and_hooked_layers_stay_dense(tiny_model_dir):
    class Quantized(nn.Linear):  # as bitsandbytes' Linear4bit subclasses nn.Linear
        pass

    model = tiny(tiny_model_dir)
    attn = model.model.layers[0].self_attn
    old = attn.q_proj
    attn.q_proj = Quantized(old.in_features, old.out_features, bias=False)
    attn.k_proj.register_forward_hook(lambda *_: None)  # as accelerate's offload hooks
    assert pack_for_generation(model) == 7 * model.config.num_hidden_layers + 1 - 2
    assert type(attn.q_proj) is Quantized and type(attn.k_proj) is nn.Linear


def lora_in_training(tiny_model_dir, **lora):
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: the adapters would change nothing
            nn.init.normal_(param, std=0.05)
    return model.train()


def test_a_model_in_training_generates_with_merged_packed_copies_and_gets_its_layers_back(tiny_model_dir, batch):
    model = lora_in_training(tiny_model_dir)
    layers = [m for m in model.modules() if m is not model]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model.eval()(batch).logits
    with packed_while_generating(model) as packed, torch.no_grad():
        assert packed == 7 * model.config.num_hidden_layers + 1  # every adapted layer, adapters merged, and the head
        assert not any(type(m).__name__ == "Linear" for m in model.base_model.model.model.layers.modules())
        torch.testing.assert_close(model(batch).logits, want, rtol=1e-4, atol=1e-5)
    assert [m for m in model.modules() if m is not model] == layers  # the same modules, in the same places
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # weights and adapters untouched
    model.train()(batch, labels=batch).loss.backward()  # and it trains as before
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_layers_that_compute_otherwise_stay_as_they_are_while_generating(tiny_model_dir, batch):
    dora = lora_in_training(tiny_model_dir, use_dora=True)
    with packed_while_generating(dora) as packed:
        assert packed == 1  # DoRA's layers read their base weight: only the head is packed
    model = lora_in_training(tiny_model_dir)
    with model.disable_adapter(), packed_while_generating(model) as packed:
        assert packed == 1  # adapters off: peft's layers run the base alone, and stay
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_while_generating(model) as packed:
        assert packed == 0  # the packed op has no autocast rule
    with pytest.raises(ValueError), packed_while_generating(model):
        raise ValueError("generation failed")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # put back on the way out of an error too
