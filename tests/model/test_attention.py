"""Padding-free attention: a flattened batch gives the padded batch's losses and gradients."""

from __future__ import annotations

import pytest
import torch

from tuneforge.batch import Layout
from tuneforge.data.collate import Collator
from tuneforge.model import attention
from tuneforge.train.objectives import lm_objective

X = -100


def rows():
    generator = torch.Generator().manual_seed(1)
    out = []
    for n in (7, 3, 12):
        ids = torch.randint(3, 2000, (n,), generator=generator).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [X, X] + ids[2:]})
    return out


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = lm_objective(model, batch).loss_sum
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("implementation", ["sdpa", "eager", attention.PACKED_SDPA])
def test_flattened_batch_matches_the_padded_batch(tiny_model_dir, implementation):
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    padded_loss, padded_grads = loss_and_grads(model, Collator(pad_token_id=2)(rows()))
    model.set_attn_implementation(implementation)
    flat_batch = Collator(pad_token_id=2, layout=Layout(flat=True))(rows())
    flat_loss, flat_grads = loss_and_grads(model, flat_batch)
    assert lm_objective.count(flat_batch) == 5 + 1 + 10
    assert flat_loss == pytest.approx(padded_loss, rel=1e-5)
    assert padded_grads.keys() == flat_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(flat_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_sdpa_runs_each_sequence_on_its_own(tiny_model_dir, monkeypatch):
    """The per-sequence kernel calls are causal and mask-free: never the whole row under a mask."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.set_attn_implementation(attention.PACKED_SDPA)
    calls = []
    original = sdpa_attention.sdpa_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[2], attention_mask is None, kwargs.get("is_causal")))
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    with torch.no_grad():
        model(**Collator(2, Layout(flat=True))(rows()).model_inputs)
    assert calls == [(7, True, True), (3, True, True), (12, True, True)] * model.config.num_hidden_layers


def test_generation_keeps_sdpa_behaviour(tiny_model_dir):
    """Without sequence boundaries (generation, padded batches) the kernel is transformers' sdpa."""
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([[2, 2, 11, 12, 13], [21, 22, 23, 24, 25]])  # left-padded first row
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)
    model.set_attn_implementation(attention.PACKED_SDPA)
    got = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert got.tolist() == expected.tolist()


def test_load_model_uses_packed_sdpa_unless_padding_free_is_off(make_cfg, tmp_path):
    from tuneforge.model import load_model

    model = load_model(make_cfg(finetuning_type="lora"))
    assert model.config._attn_implementation == attention.PACKED_SDPA
    assert attention.supports_padding_free(model)
    assert load_model(make_cfg(padding_free=False)).config._attn_implementation == "sdpa"
    assert load_model(make_cfg(flash_attn="disabled")).config._attn_implementation == "eager"
    # a saved model names no attention of ours: plain transformers loads it
    full = load_model(make_cfg(finetuning_type="full"))
    full.save_pretrained(tmp_path)
    assert "tuneforge" not in (tmp_path / "config.json").read_text()
