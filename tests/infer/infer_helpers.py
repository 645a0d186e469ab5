"""Helpers for the inference tests: configs, the tool conversation, and an API server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

TOOLS = [{"name": "get_weather", "description": "The current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = "What is the weather in Paris?"
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
RESULT = json.dumps({"temperature": 21})
FINAL = "It is 21 degrees in Paris."


def save_tiny_llama(out, tokenizer, wrap=None, **config):
    """A tiny random Llama (hidden 32, 2 layers, tied head) on the built-in tokenizer, saved with it in out; wrap: a
    callable that wraps the model before saving (a value head); config: LlamaConfig keys that differ."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, **config,
    })
    model = LlamaForCausalLM(config)
    (wrap(model) if wrap else model).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def infer_cfg(model_dir, **keys):
    from tuneforge.config import from_dict

    raw = {"model_name_or_path": str(model_dir), "do_sample": False, "max_new_tokens": 16, **keys}
    return from_dict(raw, source="infer-test.yaml", for_training=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def api_server(engine, api_key=None):
    """Serve engine on 127.0.0.1 (a free port) from a background thread; yields the base URL."""
    import uvicorn

    from tuneforge.infer.api import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key=api_key), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
