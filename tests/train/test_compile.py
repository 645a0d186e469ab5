"""torch_compile: a run with compiled decoder layers trains to the same losses as one without."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from torch._dynamo.utils import counters
from train_helpers import collate, make_cfg, random_dataset

from tuneforge.model import load_model
from tuneforge.model.adapters import decoder_layers
from tuneforge.train import Trainer


def _train(cfg, data):
    torch.manual_seed(0)
    model = load_model(cfg, device=torch.device("cpu"))
    trainer = Trainer(cfg, model, None, data, None, collate)
    trainer.train()
    return model, [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_compiled_layers_train_to_the_same_losses_and_save_the_same_weights(tmp_path, tiny_model_dir):
    data = random_dataset([8] * 4, high=50)  # one shape: compiled once
    runs = {}
    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):
        # inductor (C++ kernels on the CPU), full fine-tuning, gradient checkpointing on every layer: the layers'
        # parts are compiled and recomputed through their compiled code in the backward
        cfg = make_cfg(tmp_path / f"out-{compiled}", tiny_model_dir, torch_compile=compiled, max_steps=3,
                       disable_gradient_checkpointing=False)
        runs[compiled] = _train(cfg, data)
    model, losses = runs[True]
    _, layers = decoder_layers(model)
    assert all(part._compiled_call_impl is not None for layer in layers for part in layer.children())
    assert counters["stats"]["unique_graphs"] >= 3 and not counters["graph_break"]  # attention, MLP, norm graphs
    assert losses == pytest.approx(runs[False][1], rel=1e-4)
    saved = {c: load_file(tmp_path / f"out-{c}" / "model.safetensors") for c in (False, True)}
    assert saved[True].keys() == saved[False].keys()  # no compile wrapper in the names
    for name, weight in saved[False].items():
        torch.testing.assert_close(saved[True][name], weight, rtol=1e-3, atol=1e-5)


def test_compile_backend_alone_turns_compilation_on_for_whole_layers_without_checkpointing(tmp_path, tiny_model_dir):
    data = random_dataset([6, 5])
    runs = {}
    for backend in (None, "aot_eager"):  # aot_eager: torch's own tracing and autograd, no code generation
        cfg = make_cfg(tmp_path / f"out-{backend}", tiny_model_dir, torch_compile_backend=backend,
                       finetuning_type="lora", disable_gradient_checkpointing=True, max_steps=2)
        runs[backend] = _train(cfg, data)
    model, losses = runs["aot_eager"]
    _, layers = decoder_layers(model)  # under the peft wrapper: the adapters are compiled with their layer
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert losses == pytest.approx(runs[None][1], rel=1e-5)
