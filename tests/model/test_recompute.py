"""Activations one cheap pass away from tensors autograd keeps anyway are kept as recipes in the training forward:
the same numbers, less memory kept."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from model_helpers import loss_and_backward
from torch import nn

from tuneforge.model import attention, fused_norm, lean_mlp, load_model, recompute
from tuneforge.model.mixed_precision import autocast_inputs, plain_lora_layers


@pytest.fixture
def kept(monkeypatch):
    """What the training forward stores: the bytes of the tensors kept as such, and how many recipes."""
    storages: dict[int, int] = {}
    recipes: list = []
    pack = recompute._pack

    def counting(t):
        packed = pack(t)
        if isinstance(packed, torch.Tensor):
            storages[packed.untyped_storage().data_ptr()] = packed.untyped_storage().nbytes()
        elif packed.recipe not in recipes:
            recipes.append(packed.recipe)
        return packed

    monkeypatch.setattr(recompute, "_pack", counting)

    def run(forward, recipes_on: bool = True) -> tuple[int, int]:
        storages.clear()
        recipes.clear()
        if recipes_on:
            with recompute.recomputing():
                forward()
        else:
            with torch.autograd.graph.saved_tensors_hooks(counting, lambda t: t):
                forward()
        return sum(storages.values()), len(recipes)

    return run


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TinyRMSNorm(nn.Module):  # transformers' Llama RMSNorm
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _grads(module, x, recipes_on: bool):
    module.zero_grad()
    x.grad = None
    with recompute.recomputing() if recipes_on else torch.enable_grad():
        out = module(x)
    out.pow(2).sum().backward()
    return [out.detach(), x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("build, swap, kept_once", [
    (TinyMLP, lean_mlp.lean_gated_mlps, 5 * 32 * 4),  # silu(gate) * up, down_proj's input
    (lambda: nn.Sequential(TinyRMSNorm(8), nn.Linear(8, 4)), fused_norm.fuse_rms_norms, 5 * 8 * 4),  # the norm's output
])
def test_a_marked_activation_is_computed_again_in_backward_bit_for_bit(kept, build, swap, kept_once):
    torch.manual_seed(0)
    module = build()
    assert swap(module) == 1
    x = torch.randn(5, 8, requires_grad=True)
    (plain_bytes, no_recipes), (bytes_, recipes) = kept(lambda: module(x), False), kept(lambda: module(x))
    assert (no_recipes, recipes) == (0, 1)
    assert plain_bytes - bytes_ == kept_once
    expected, got = _grads(module, x, False), _grads(module, x, True)
    assert len(expected) > 3
    for value, want in zip(got, expected, strict=True):
        assert torch.equal(value, want)
    assert not recompute._marked  # forgotten once the forward is over


def test_padding_free_attention_keeps_its_output_once(kept):
    """sdpa keeps each sequence's output for its backward; o_proj's input (those outputs side by side) is a recipe."""
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 13, 8, generator=generator, requires_grad=True) for heads in (6, 2, 2))
    weight = torch.randn(48, 4, generator=generator, requires_grad=True)
    bounds = torch.tensor([0, 7, 8, 13], dtype=torch.int32)

    def forward():
        out = attention.packed_sdpa_attention_forward(module, q, k, v, None, cu_seq_lens_q=bounds)[0]
        return out.reshape(13, 48) @ weight  # o_proj keeps its input for the weight's gradient

    (plain_bytes, _), (bytes_, recipes) = kept(forward, False), kept(forward)
    assert recipes == 1 and plain_bytes - bytes_ == 13 * 48 * 4
    grads = []
    for recipes_on in (False, True):
        weight.grad = q.grad = None
        with recompute.recomputing() if recipes_on else torch.enable_grad():
            out = forward()
        out.pow(2).sum().backward()
        grads.append((weight.grad, q.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_the_marked_tensor_itself_is_freed_after_the_forward():
    x = torch.randn(4, 8)
    alive = {}
    for recipes_on in (False, True):
        weight = torch.randn(8, 8, requires_grad=True)
        with recompute.recomputing() if recipes_on else torch.enable_grad():
            y = recompute.remember(x * 2, lambda t: t * 2, x)
            loss = (y @ weight).sum()  # mm keeps y for weight's gradient
        ref = weakref.ref(y)
        del y
        alive[recipes_on] = ref() is not None  # held by the graph until backward, or not at all
        loss.backward()
        assert torch.equal(weight.grad, (x * 2).T @ torch.ones(4, 8))
    assert alive == {False: True, True: False}


def test_outside_the_training_forward_nothing_is_marked():
    x = torch.randn(3, requires_grad=True)
    recompute.remember(x * 2, lambda t: t * 2, x)
    assert not recompute._marked
    with recompute.recomputing(), torch.no_grad():
        recompute.remember(x * 2, lambda t: t * 2, x)
        assert not recompute._marked


def test_a_marked_tensor_changed_in_place_before_it_is_saved_is_kept_as_it_is():
    weight = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4)
    with recompute.recomputing():
        y = recompute.remember(x * 2, lambda t: t * 2, x)
        y.add_(1)  # computing x * 2 again would miss this
        (y @ weight).sum().backward()
    assert torch.equal(weight.grad, (x * 2 + 1).T @ torch.ones(2, 3))


def test_an_input_changed_in_place_after_the_forward_is_refused_not_used():
    weight = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4)
    with recompute.recomputing():
        y = recompute.remember(x * 2, lambda t: t * 2, x)
        loss = (y @ weight).sum()
    x.add_(1)
    with pytest.raises(RuntimeError, match="changed in place after the forward"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_step_of_the_tiny_llama_is_bit_identical_with_less_kept(make_cfg, batch, kept, dtype):
    torch.manual_seed(0)
    bf16 = dtype == torch.bfloat16
    model = load_model(make_cfg(finetuning_type="lora", disable_gradient_checkpointing=True, bf16=bf16))
    for name, param in model.named_parameters():  # B starts at zero, which would leave A without a gradient
        if ".lora_B." in name:
            param.data.copy_(torch.linspace(-0.1, 0.1, param.numel()).view_as(param))
    layers = plain_lora_layers(model)

    def step(recipes_on: bool):
        model.zero_grad()
        with recompute.recomputing() if recipes_on else torch.enable_grad(), autocast_inputs(layers):
            return loss_and_backward(model, batch, dtype).detach(), {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (plain_loss, plain_grads), (loss, grads) = step(False), step(True)
    assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    with autocast_inputs(layers):
        (plain_bytes, _), (bytes_, recipes) = (kept(lambda: loss_and_backward(model, batch, dtype), False),
                                               kept(lambda: loss_and_backward(model, batch, dtype)))
    # per layer: both norms' outputs and the MLP's product (the final norm's output feeds the frozen head only); in
    # bf16 also the norms' fp32 copies of their input, kept as recipes on the bf16 input: two per layer, less the
    # first norm's (its input, the frozen embeddings' output, needs no gradient), plus the final norm's
    h, i, tokens = model.config.hidden_size, model.config.intermediate_size, batch.numel()
    assert recipes == 2 * (5 if bf16 else 3)
    assert plain_bytes - bytes_ == 2 * tokens * (2 * (2 * h + i) + 2 * 4 * h if bf16 else 4 * (2 * h + i))
