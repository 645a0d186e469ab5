"""shift_attn (LongLoRA's S²-Attn): against a reference written from the definition, in the model (training only,
each sequence of a padding-free row apart), and the configurations it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from tuneforge.errors import ConfigError
from tuneforge.model import load_model
from tuneforge.model.shifted_attention import shifted_sparse_attention


def s2_reference(query, key, value):
    """Each head, each query token by token: S²-Attn as LongLoRA defines it. Groups of int(n / 4) consecutive tokens
    (the last may be short); heads of the second half read the sequence shifted by half a group (wrapping around);
    a token attends causally to the tokens of its own group."""
    _, heads, n, d = query.shape
    size = max(1, int(n / 4))
    out = torch.zeros(1, n, heads, d, dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // key.shape[1])
        order = list(range(n))
        if h >= heads // 2:
            order = order[size // 2 :] + order[: size // 2]  # the token at each shifted place
        for j, token in enumerate(order):
            seen = [order[i] for i in range(j - j % size, j + 1)]  # its group, up to itself
            scores = torch.stack([query[0, h, token].double() @ key[0, kv, s].double() / math.sqrt(d) for s in seen])
            weights = torch.softmax(scores, 0)
            out[0, token, h] = sum(w * value[0, kv, s].double() for w, s in zip(weights, seen, strict=True))
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "length"), [(4, 2, 13), (4, 4, 16), (6, 3, 9), (2, 1, 3)])
def test_s2_attention_is_the_definition(heads, kv_heads, length):
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(1, heads, length, 8, generator=generator)
    k, v = (torch.randn(1, kv_heads, length, 8, generator=generator) for _ in range(2))
    torch.testing.assert_close(shifted_sparse_attention(q, k, v).double(), s2_reference(q, k, v), atol=1e-5, rtol=0)


def row(lengths, seed=0):
    from tuneforge.data.collate import flatten

    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(3, 2000, (n,), generator=generator).tolist()} for n in lengths]
    return flatten(rows)[0]


def test_the_model_trains_with_s2_and_evaluates_with_full_attention(make_cfg):
    shifted = load_model(make_cfg(shift_attn=True, finetuning_type="full", disable_gradient_checkpointing=True),
                         device="cpu")
    plain = load_model(make_cfg(finetuning_type="full", disable_gradient_checkpointing=True), device="cpu")
    inputs = row([40, 24])
    with torch.no_grad():
        trained = shifted.train()(**inputs).logits
        alone = shifted(**row([40])).logits  # the row's first sequence (the same seed draws the same tokens)
        torch.testing.assert_close(trained[:, :40], alone)  # the row's sequences never see each other
        assert not torch.allclose(trained, plain.train()(**inputs).logits, atol=1e-4)
        torch.testing.assert_close(shifted.eval()(**inputs).logits, plain.eval()(**inputs).logits)
    loss = shifted.train()(**inputs).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert shifted.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("keys", "message"), [
    ({"stage": "dpo", "dataset": "x"}, "shift_attn trains stages pt and sft"),
    ({"padding_free": False}, "set padding_free: true and flash_attn: auto"),
    ({"sequence_parallel_size": 2}, "cannot be combined"),
])
def test_what_shift_attn_does_not_run_is_refused(make_cfg, keys, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(shift_attn=True, **keys)
