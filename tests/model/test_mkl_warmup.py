"""mkl_warmup: every VML function settled on one thread, before a model loads (and so before it runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from tuneforge.model import load as load_module
from tuneforge.model.mkl_warmup import DTYPES, FUNCTIONS


def test_each_function_is_called_once_per_dtype_on_one_element_once_per_process():
    # in a fresh process: this one has settled everything already (tests/conftest.py does it for the session)
    script = textwrap.dedent("""
        import json, threading, torch
        from torch.overrides import TorchFunctionMode
        from tuneforge.model.mkl_warmup import settle_vml_dispatch

        calls = []
        class Record(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.__name__ != "full":
                    calls.append([func.__name__, str(args[0].dtype), args[0].numel(),
                                  threading.current_thread() is threading.main_thread()])
                return out
        with Record():
            first, second = settle_vml_dispatch(), settle_vml_dispatch()
        print(json.dumps({"calls": calls, "counts": [first, second]}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    if not torch.backends.mkl.is_available():
        assert report == {"calls": [], "counts": [0, 0]}
        return
    expected = {(name, str(dtype)) for name in FUNCTIONS for dtype in DTYPES}
    assert {(name, dtype) for name, dtype, _, _ in report["calls"]} == expected
    assert len(report["calls"]) == len(expected) == report["counts"][0] == report["counts"][1]  # the second: cached
    # one element runs inline on the calling thread (torch splits a call over its threads from 2,048 elements)
    assert all(numel == 1 and main for _, _, numel, main in report["calls"])


def test_a_model_loads_after_the_functions_are_settled(make_cfg, monkeypatch):
    order = []
    monkeypatch.setattr(load_module, "settle_vml_dispatch", lambda: order.append("settled"))
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        order.append("loaded")
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    load_module.load_model(make_cfg(finetuning_type="lora"))
    assert order == ["settled", "loaded"]
