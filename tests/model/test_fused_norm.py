"""RMSNorm through torch's fused kernel: swapped only where the probe agrees, same outputs and gradients."""

from __future__ import annotations

import torch
from model_helpers import loss_and_backward
from torch import nn

from tuneforge.model import load_model
from tuneforge.model.fused_norm import fuse_rms_norms


class OnePlusWeightRMSNorm(nn.Module):  # Gemma's form: scales by 1 + weight, which the fused forward does not
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.randn(hidden)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def test_a_norm_of_another_form_is_left_alone():
    norm = OnePlusWeightRMSNorm(16)
    assert fuse_rms_norms(nn.Sequential(norm)) == 0
    assert "forward" not in vars(norm)


def test_llama_norms_are_fused_with_the_same_loss_and_gradients(make_cfg, batch):
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = load_model(make_cfg(bf16=True, finetuning_type="full", disable_gradient_checkpointing=True))
        base = model.model
        norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm,
                                                                     layer.post_attention_layernorm)]
        assert all(("forward" in vars(n)) for n in norms)  # load_model fuses them (2 layers x 2 + the final one)
        if not fused:
            for n in norms:
                del n.forward  # back to transformers' own forward
        loss = loss_and_backward(model, batch, torch.bfloat16)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (loss, grads) = results
    assert torch.equal(loss, plain_loss)  # the forward is bit-identical (the probe's condition)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)  # backward: fp32 sums in another order
