"""Fixtures for the inference tests: tiny models and an engine (helpers are in infer_helpers.py).

- `rm_model_dir`: a tiny random Llama (hidden 32, context 4096) saved as a reward-model folder (the model
  plus value_head.safetensors, as a stage rm run writes it); it chats too (the value head only adds scoring).
- `tool_model_dir`: the tiny Llama fine-tuned by tuneforge's own trainer (sft, full) until it answers
  one tool-using conversation from memory, so the server sees a real tool call in a real model's output.
"""

from __future__ import annotations

import json

import pytest
import torch
from infer_helpers import CALL, FINAL, QUESTION, RESULT, TOOLS, infer_cfg, save_tiny_llama


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and the machine's cores are shared with other runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def rm_model_dir(tmp_path_factory, tokenizer):
    from tuneforge.model.value_head import ValueHeadModel

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-rm"), tokenizer, wrap=ValueHeadModel)


@pytest.fixture(scope="session")
def rm_engine(rm_model_dir):
    from tuneforge.infer.engine import Engine

    engine = Engine.from_config(infer_cfg(rm_model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory, tiny_model_dir):
    """Train the tiny model on one conversation: question -> get_weather call -> result -> answer."""
    from tuneforge.config import from_dict
    from tuneforge.workflow import run

    root = tmp_path_factory.mktemp("tool-data")
    row = {"conversations": [
        {"from": "human", "value": QUESTION}, {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": RESULT}, {"from": "gpt", "value": FINAL},
    ], "tools": json.dumps(TOOLS)}
    (root / "tool.json").write_text(json.dumps([row]))
    (root / "dataset_info.json").write_text(json.dumps({"tool": {
        "file_name": "tool.json", "formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}}))
    out = tmp_path_factory.mktemp("tool-model")
    cfg = from_dict({
        "model_name_or_path": str(tiny_model_dir), "stage": "sft", "finetuning_type": "full", "dataset": "tool",
        "dataset_dir": str(root), "output_dir": str(out), "overwrite_output_dir": True, "max_steps": 60,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "per_device_train_batch_size": 1, "bf16": False,
        "save_strategy": "no", "logging_steps": 20, "disable_tqdm": True, "cutoff_len": 256,
    }, source="tool-train.yaml")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:  # the tokenized-data cache goes to a temporary folder
        mp.setenv("TUNEFORGE_HOME", str(tmp_path_factory.mktemp("tool-home")))
        torch.set_num_threads(1)  # a session fixture: set up before the module's _one_thread
        try:
            result = run(cfg)
        finally:
            torch.set_num_threads(threads)
    assert result["last_loss"] < 0.2, result  # memorized
    return out
