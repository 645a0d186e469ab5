"""Fixtures for the model tests: a config builder on the tiny model and a fixed batch."""

from __future__ import annotations

import pytest
import torch

from tuneforge.config import from_dict


@pytest.fixture
def make_cfg(tiny_model_dir):
    """make_cfg(key=value, ...) -> a validated RunConfig on the tiny model (no data or output needed)."""

    def build(**keys):
        return from_dict({"model_name_or_path": str(tiny_model_dir), **keys}, for_training=False)

    return build


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, 2000, (2, 8), generator=generator)
