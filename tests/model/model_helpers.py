"""Small helpers shared by the model tests."""

from __future__ import annotations

import torch


def loss_and_backward(model, input_ids, dtype=torch.float32):
    """One forward + backward as the trainer runs it (autocast to the run's dtype)."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss


def trainable_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def input_and_output_embeddings(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_input_embeddings(), base.get_output_embeddings()
