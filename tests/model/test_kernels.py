"""The kernel keys on the tiny model: tf32's switches, fp32 norms and head output, and torchao's float8 layers
(emulated: float8 numerics without float8 matmuls, which need a GPU). torch_compile: tests/train/test_compile.py."""

from __future__ import annotations

import logging

import pytest
import torch

from tuneforge.batch import Batch, Layout
from tuneforge.model import load_model
from tuneforge.model.adapters import decoder_layers
from tuneforge.model.kernels import set_tf32, to_float8
from tuneforge.train.objectives.token_logps import token_losses


def test_tf32_sets_cudas_precision_and_is_ignored_on_the_cpu(caplog):
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    before = [f.fp32_precision for f in flags]
    try:
        with caplog.at_level(logging.WARNING):
            set_tf32(True, torch.device("cpu"))
        assert [f.fp32_precision for f in flags] == before
        assert "tf32: true changes nothing here" in caplog.text
        set_tf32(True, torch.device("cuda"))
        assert [f.fp32_precision for f in flags] == ["tf32"] * 3
        set_tf32(False, torch.device("cuda"))
        assert [f.fp32_precision for f in flags] == ["ieee"] * 3
    finally:
        for f, value in zip(flags, before, strict=True):
            f.fp32_precision = value


def _batch(ids: torch.Tensor) -> Batch:
    labels = ids.clone()
    labels[:, :2] = -100
    return Batch({"input_ids": ids}, {"labels": labels}, Layout(), num_rows=ids.shape[0], num_tokens=ids.numel())


def _bf16_loss(model, batch) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return token_losses(model, batch).sum()


def test_upcast_layernorm_keeps_norms_in_fp32(make_cfg, batch):
    plain = load_model(make_cfg(bf16=True), device=torch.device("cpu"))
    upcast = load_model(make_cfg(bf16=True, upcast_layernorm=True), device=torch.device("cpu"))
    norms = {name for name, module in upcast.named_modules() if "norm" in type(module).__name__.lower()}
    assert len(norms) == 5  # 2 layers x (input, post-attention) + the final norm
    for name, param in upcast.named_parameters():
        owner = name.rsplit(".", 1)[0]
        expected = torch.float32 if owner in norms or param.requires_grad else torch.bfloat16
        assert param.dtype == expected, name
    assert {p.dtype for n, p in plain.named_parameters() if "norm" in n} == {torch.bfloat16}
    reference = load_model(make_cfg(), device=torch.device("cpu"))  # fp32 weights, no autocast
    b = _batch(batch)
    with torch.no_grad():
        exact = float(token_losses(reference, b).sum())
    assert float(_bf16_loss(upcast, b)) == pytest.approx(exact, rel=2e-2)


def test_upcast_lmhead_output_gives_fp32_logits_and_the_same_loss(make_cfg, batch):
    plain = load_model(make_cfg(bf16=True), device=torch.device("cpu"))
    upcast = load_model(make_cfg(bf16=True, upcast_lmhead_output=True), device=torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(input_ids=batch).logits.dtype == torch.bfloat16
        assert upcast(input_ids=batch).logits.dtype == torch.float32
    b = _batch(batch)
    # tuneforge's loss casts each logits chunk to fp32 itself: the same loss either way, on both head paths
    for head in ("fused", "forward"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(token_losses(upcast, b, head=head), token_losses(plain, b, head=head))


def test_float8_layers_replace_the_decoders_linears(make_cfg, batch):
    from torchao.float8.float8_linear import Float8Linear

    cfg = make_cfg(finetuning_type="full")
    model = load_model(cfg, device=torch.device("cpu"))
    b = _batch(batch)
    reference = float(token_losses(model, b).sum())
    assert to_float8(model, cfg.train, emulate=True) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert not isinstance(model.get_output_embeddings(), Float8Linear)
    loss = token_losses(model, b).sum()
    loss.backward()
    assert float(loss) == pytest.approx(reference, rel=1e-2)  # float8's rounding, within 1%
    _, layers = decoder_layers(model)
    assert layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
