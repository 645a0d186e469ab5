"""Small helpers shared by the model tests."""

from __future__ import annotations

import torch


def loss_and_backward(model, input_ids, dtype=torch.float32):
    """One forward + backward as the trainer runs it (autocast to the run's dtype)."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss


def loss_and_grads(model, input_ids, dtype=torch.float32):
    """loss_and_backward from zeroed gradients: the loss and a copy of every gradient, by parameter name."""
    model.zero_grad()
    loss = loss_and_backward(model, input_ids, dtype)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def nonzero_lora_b(model) -> None:
    """LoRA's B starts at zero, which would leave the update (and A's gradient) out of a comparison."""
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            param.data.copy_(torch.linspace(-0.1, 0.1, param.numel()).view_as(param))


def trainable_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def input_and_output_embeddings(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_input_embeddings(), base.get_output_embeddings()
