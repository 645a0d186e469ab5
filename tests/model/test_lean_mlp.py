"""The gated MLP keeps gate and up for backward, not silu(gate) too: the same numbers, a tensor less."""

from __future__ import annotations

import torch
from model_helpers import loss_and_grads, nonzero_lora_b
from torch import nn

from tuneforge.model import lean_mlp, load_model


def _mlps(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]


def test_training_with_the_lean_mlp_is_bit_identical(make_cfg, batch, monkeypatch):
    cfg = make_cfg(finetuning_type="lora", disable_gradient_checkpointing=True)
    torch.manual_seed(0)
    lean = load_model(cfg)
    assert len(_mlps(lean)) == 2 and all(m.forward.__func__ is lean_mlp._lean_forward for m in _mlps(lean))
    monkeypatch.setattr("tuneforge.model.load.lean_gated_mlps", lambda model: 0)
    torch.manual_seed(0)
    plain = load_model(cfg)
    assert not any("forward" in vars(m) for m in _mlps(plain))
    for model in (lean, plain):
        nonzero_lora_b(model)
    (loss, grads), (plain_loss, plain_grads) = loss_and_grads(lean, batch), loss_and_grads(plain, batch)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


def _saved_bytes(forward, x) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(x)
    return sum(storages.values())


class TinyMLP(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 8)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_the_lean_mlp_keeps_one_intermediate_tensor_less():
    torch.manual_seed(0)
    mlp = TinyMLP(nn.SiLU())
    x = torch.randn(5, 8, requires_grad=True)
    before = _saved_bytes(mlp, x)
    assert lean_mlp.lean_gated_mlps(mlp) == 1
    # autograd kept x, gate, silu(gate), up, the product (and the weights); the lean MLP the same but silu(gate)
    assert before - _saved_bytes(mlp, x) == 5 * 32 * 4


def test_an_mlp_with_another_activation_keeps_its_forward():
    mlp = TinyMLP(nn.GELU())
    assert lean_mlp.lean_gated_mlps(mlp) == 0
    assert "forward" not in vars(mlp)
