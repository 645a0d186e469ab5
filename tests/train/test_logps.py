"""Per-sequence log-probs against a brute-force full-logits computation, padded and padding-free."""

from __future__ import annotations

import pytest
import torch
from preference_helpers import brute_force_logps, collate_sequences, pairwise_sequences
from train_helpers import load_model

from tuneforge.train.objectives.logps import sequence_logps

# 2 pairs: prompts of 3 and 5 tokens; chosen completions of 4 and 2, rejected of 3 and 6 tokens
SHAPE = ([3, 5], [4, 2], [3, 6])


@pytest.fixture
def sequences():
    return pairwise_sequences(*SHAPE, seed=1)


@pytest.mark.parametrize("head,chunk", [("auto", None), ("fused", 2), ("forward", None), ("forward", 3)])
@pytest.mark.parametrize("padding_free", [False, True])
def test_matches_brute_force_full_logits(tiny_model_dir, sequences, head, chunk, padding_free):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        expected, expected_counts = brute_force_logps(model, sequences)
        out = sequence_logps(model, collate_sequences(sequences, padding_free), head=head, chunk_tokens=chunk)
    # a completion of n tokens has n targets: the first is predicted from the prompt's last token
    assert out.counts.tolist() == expected_counts.tolist() == [4.0, 2.0, 3.0, 6.0]
    assert out.logps.dtype == out.counts.dtype == torch.float32
    torch.testing.assert_close(out.logps, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.average(), expected / expected_counts, rtol=1e-5, atol=1e-5)


def test_padded_equals_padding_free(tiny_model_dir, sequences):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        padded = sequence_logps(model, collate_sequences(sequences, padding_free=False))
        flat = sequence_logps(model, collate_sequences(sequences, padding_free=True))
    torch.testing.assert_close(padded.logps, flat.logps, rtol=1e-5, atol=1e-5)
    assert padded.counts.tolist() == flat.counts.tolist()


def _weighted_gradients(model, logps: torch.Tensor) -> dict[str, torch.Tensor]:
    # distinct weights per sequence so a token credited to the wrong sequence changes the gradient
    weights = torch.tensor([1.0, -0.5, 2.0, 0.25])
    (weights * logps).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("head,padding_free", [("fused", False), ("fused", True), ("forward", True)])
def test_gradients_equal_the_brute_force(tiny_model_dir, sequences, head, padding_free):
    reference_model = load_model(tiny_model_dir)
    expected = _weighted_gradients(reference_model, brute_force_logps(reference_model, sequences)[0])
    model = load_model(tiny_model_dir)
    batch = collate_sequences(sequences, padding_free)
    got = _weighted_gradients(model, sequence_logps(model, batch, head=head, chunk_tokens=2).logps)
    assert got.keys() == expected.keys() and len(got) > 0
    for name, grad in expected.items():  # fp32 sums in another order: 1e-5 of the largest entry
        scale = float(grad.abs().max())
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5 * max(scale, 1.0), msg=name)


def _lora_model(model_dir):
    model = load_model(model_dir, lora={})
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA B starts at zero, which would leave lora_A without a gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


@pytest.mark.parametrize("padding_free", [False, True])
def test_frozen_head_gradients_equal_the_brute_force_with_one_projection_per_chunk(
    tiny_model_dir, sequences, padding_free
):
    reference_model = _lora_model(tiny_model_dir)
    expected = _weighted_gradients(reference_model, brute_force_logps(reference_model, sequences)[0])
    model = _lora_model(tiny_model_dir)
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    batch = collate_sequences(sequences, padding_free)
    logps = sequence_logps(model, batch, head="fused", chunk_tokens=4).logps
    with torch.no_grad():  # a reference's pass: its log-probs must equal the policy's exactly (dpo's first rewards)
        assert torch.equal(sequence_logps(model, batch, head="fused", chunk_tokens=4).logps, logps.detach())
    calls.clear()
    got = _weighted_gradients(model, logps)
    # 15 targets in chunks of 4: the head's gradient was taken in the forward, so the backward projects nothing
    assert calls == []
    assert got.keys() == expected.keys() and any("lora_A" in name for name in got)
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5 * max(scale, 1.0), msg=name)


def test_peft_model_uses_its_adapters(tiny_model_dir, sequences):
    model = load_model(tiny_model_dir, lora={})
    with torch.no_grad():  # a LoRA B of zeros would make the adapter invisible: give it weights
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
        expected, _ = brute_force_logps(model, sequences)
        with model.disable_adapter():
            base, _ = brute_force_logps(model, sequences)
        out = sequence_logps(model, collate_sequences(sequences, padding_free=True))
    assert (expected - base).abs().max() > 1e-3
    torch.testing.assert_close(out.logps, expected, rtol=1e-5, atol=1e-5)


def test_sequences_without_targets_give_zero_and_backpropagate(tiny_model_dir):
    model = load_model(tiny_model_dir)
    batch = collate_sequences([([5, 6, 7], [-100, -100, -100]), ([8, 9], [-100, -100])], padding_free=False)
    out = sequence_logps(model, batch)
    out.logps.sum().backward()
    assert out.logps.tolist() == [0.0, 0.0] and out.counts.tolist() == [0.0, 0.0]
    assert out.average().tolist() == [0.0, 0.0]
