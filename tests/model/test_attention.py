"""Padding-free attention: a flattened batch gives the padded batch's losses and gradients."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

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

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.set_attn_implementation(attention.PACKED_SDPA)
    calls = []
    original = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[2], attn_mask is None, kwargs.get("is_causal")))
        return original(query, key, value, attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(**Collator(2, Layout(flat=True))(rows()).model_inputs)
    assert calls == [(7, True, True), (3, True, True), (12, True, True)] * model.config.num_hidden_layers


def test_packed_sdpa_gives_transformers_sdpa_numbers_per_sequence():
    """Each sequence's output (and the gradients) exactly as transformers' sdpa path gives it for that sequence
    alone, grouped-query heads included, a one-token sequence too."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, heads, 13, 8, generator=generator) for heads in (6, 2, 2)]
    bounds = torch.tensor([0, 7, 8, 13], dtype=torch.int32)
    results = []
    for per_sequence in (True, False):
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        if per_sequence:
            out = torch.cat([sdpa_attention_forward(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None,
                                                    is_causal=True)[0] for s, e in ((0, 7), (7, 8), (8, 13))], dim=1)
        else:
            out = attention.packed_sdpa_attention_forward(module, q, k, v, None, cu_seq_lens_q=bounds)[0]
        out.pow(2).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def _half_inputs(length: int, generator: torch.Generator):
    # as the model hands them over: (1, heads, n, 64) views of (1, n, heads, 64) projections, grouped-query heads
    return [torch.randn(1, length, heads, 64, generator=generator).to(torch.bfloat16).transpose(1, 2)
            for heads in (9, 3, 3)]


def _per_sequence(inputs, bounds, scale=None):
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = attention.packed_sdpa_attention_forward(module, *leaves, None, cu_seq_lens_q=bounds, scaling=scale)[0]
    return out, leaves


def test_half_precision_sequences_run_in_fp32_on_a_cpu():
    """bf16 inputs: each sequence's output is fp32 sdpa's on the upcast inputs, rounded to bf16 once, its gradients
    fp32 sdpa's to bf16's precision (backward reads the bf16 output, as bf16 sdpa's does), and what is kept for
    backward is what bf16 sdpa keeps (the bf16 inputs and output, fp32 logsumexps)."""
    generator = torch.Generator().manual_seed(0)
    inputs, bounds = _half_inputs(40, generator), torch.tensor([0, 25, 26, 40], dtype=torch.int32)
    grad = torch.randn(1, 40, 9, 64, generator=generator).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        out, leaves = _per_sequence(inputs, bounds)
    out.backward(grad)
    for start, end in ((0, 25), (25, 26), (26, 40)):
        q, k, v = (t[:, :, start:end].float().detach().requires_grad_(True) for t in inputs)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        want.backward(grad[:, start:end].transpose(1, 2).float())
        assert out.dtype == torch.bfloat16 and torch.equal(out[:, start:end], want.transpose(1, 2).bfloat16())
        for leaf, reference in zip(leaves, (q, k, v), strict=True):
            assert leaf.grad.dtype == torch.bfloat16
            torch.testing.assert_close(leaf.grad[:, :, start:end], reference.grad.bfloat16(), rtol=0.02, atol=0.02)
    n = 25  # the first sequence; the others alike
    assert saved.count(((1, 9, n, 64), torch.bfloat16)) == 2 and saved.count(((1, 3, n, 64), torch.bfloat16)) == 2
    assert ((1, 9, n), torch.float32) in saved and not any(dtype == torch.float32 and len(shape) == 4
                                                           for shape, dtype in saved)


def test_half_precision_shared_prompt_rows_run_in_fp32_on_a_cpu():
    """A shared-prompt row in bf16 (prompt of 6, answers of 5 and 4): prompt + first answer causal, the second answer
    seeing the prompt and itself causally, each in fp32 and rounded once; gradients to bf16's precision."""
    generator = torch.Generator().manual_seed(2)
    inputs = _half_inputs(15, generator)
    grad = torch.randn(1, 15, 9, 64, generator=generator).to(torch.bfloat16)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = attention.packed_sdpa_attention_forward(module, *leaves, None, shared_prefix=torch.tensor([[0, 6, 5, 4]]))[0]
    out.backward(grad)
    q, k, v = (t.float().detach().requires_grad_(True) for t in inputs)
    visible = torch.ones(4, 10, dtype=torch.bool).tril(6)
    first = F.scaled_dot_product_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], is_causal=True, enable_gqa=True)
    keys, values = (torch.cat([t[:, :, :6], t[:, :, 11:]], dim=2) for t in (k, v))
    second = F.scaled_dot_product_attention(q[:, :, 11:], keys, values, attn_mask=visible, enable_gqa=True)
    want = torch.cat([first, second], dim=2).transpose(1, 2)
    want.backward(grad.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want.bfloat16(), rtol=0, atol=0)
    for leaf, reference in zip(leaves, (q, k, v), strict=True):
        torch.testing.assert_close(leaf.grad, reference.grad.bfloat16(), rtol=0.02, atol=0.02)


def test_half_precision_gradients_are_closer_to_exact_than_the_half_kernel():
    """Why fp32: bf16 sdpa rounds the probabilities and their gradients to bf16 before its products. Against fp64,
    a 200-token sequence: k's and v's gradients are ~2.5x closer (probed: 0.0018 / 0.0016 against 0.0048 / 0.0047)."""
    generator = torch.Generator().manual_seed(0)
    inputs, bounds = _half_inputs(200, generator), torch.tensor([0, 200], dtype=torch.int32)
    grad = torch.randn(1, 200, 9, 64, generator=generator).to(torch.bfloat16)
    out, leaves = _per_sequence(inputs, bounds)
    out.backward(grad)
    exact = [t.double().detach().requires_grad_(True) for t in inputs]
    F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True).backward(grad.transpose(1, 2).double())
    half = [t.detach().requires_grad_(True) for t in inputs]
    F.scaled_dot_product_attention(*half, is_causal=True, enable_gqa=True).backward(grad.transpose(1, 2))

    def error(t, reference):
        return float((t.grad.double() - reference.grad).norm() / reference.grad.norm())

    for ours, theirs, reference in list(zip(leaves, half, exact, strict=True))[1:]:
        assert error(ours, reference) < 0.6 * error(theirs, reference)
    assert error(leaves[0], exact[0]) < error(half[0], exact[0])


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


def test_packed_sdpa_never_takes_cudnn_attention(monkeypatch):
    """cuDNN's attention builds a graph for each new shape (~2.3 ms of CPU per call on an H100), and a padding-free
    batch brings new lengths at every step: the per-sequence and shared-prompt calls run with cuDNN's kernel off,
    and the switch is back on afterwards."""
    seen = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    module = SimpleNamespace(num_key_value_groups=1, is_causal=True)
    q, k, v = torch.randn(3, 1, 2, 9, 8).unbind(0)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    attention.packed_sdpa_attention_forward(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4, 9]))
    assert seen == [False, False]
    attention.packed_sdpa_attention_forward(module, q, k, v, None, shared_prefix=torch.tensor([[0, 3, 3, 3]]))
    assert seen == [False] * 4  # prompt + first answer, then the second answer
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_sequence_boundaries_are_read_once_per_forward(tiny_model_dir, monkeypatch):
    """Every layer gets the same boundaries tensor; reading it to the host is a GPU synchronisation, so it is read
    once per forward, not once per layer, and read again for the next batch."""
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.set_attn_implementation(attention.PACKED_SDPA)
    assert model.config.num_hidden_layers > 1
    batches = [Collator(2, Layout(flat=True))(rows()) for _ in range(2)]
    bounds = [b.model_inputs["cu_seq_lens_q"] for b in batches]
    reads = []
    original = torch.Tensor.tolist

    def spy(tensor):
        reads.extend(i for i, b in enumerate(bounds) if tensor is b)
        return original(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    for batch in batches:
        with torch.no_grad():
            model(**batch.model_inputs)
    assert reads == [0, 1]
