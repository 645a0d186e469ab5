"""Which sdpa kernel torch picks on this device, and what a call costs with it and without cuDNN's attention.

On an H100 (torch 2.11) cuDNN's attention built an execution graph for each new shape: ~2.3 ms of CPU a call, and
padding-free training brings new lengths at every step (docs/performance.md). tuneforge's padding-free attention
has run without cuDNN's kernel since. Generation has the same pattern: each decode step's keys are one longer, under
a padding mask. This probe times both patterns with torch's own choice and without cuDNN's kernel, so one GPU run
says whether generation needs the same treatment. benchmarks/gpu_bench.py runs it first; alone:

    python benchmarks/attention_probe.py [--dry-run]

Prints one JSON object: per pattern, the kernel torch picks (`torch._fused_sdp_choice`) and milliseconds a call
(synchronised): with torch's choice on shapes new to it, on the same shapes again, and without cuDNN's kernel.
--dry-run: small shapes on the CPU, to check the flow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tuneforge.model.attention import WITHOUT_CUDNN

# a 1.1B Llama's attention (F1B): 32 query heads, 4 key-value heads of 64; lengths of alpaca rows at cutoff 1024
FULL = {"heads": 32, "kv_heads": 4, "dim": 64, "lengths": [97, 211, 64, 533, 150, 388, 1024, 77, 260, 129, 700, 180],
        "batch": 16, "prompt": 200, "steps": 32}
DRY = {"heads": 4, "kv_heads": 2, "dim": 16, "lengths": [9, 17, 12], "batch": 2, "prompt": 8, "steps": 3}


def training_inputs(shape: dict, device: str, dtype: torch.dtype) -> list[tuple]:
    """One causal sequence per call, each of a length not met before (as in a padding-free batch); with gradients."""
    h, g, d = shape["heads"], shape["kv_heads"], shape["dim"]
    return [(*(torch.randn(1, heads, n, d, device=device, dtype=dtype, requires_grad=True) for heads in (h, g, g)),
             {"is_causal": True}) for n in shape["lengths"]]


def decode_inputs(shape: dict, device: str, dtype: torch.dtype) -> list[tuple]:
    """Decode steps of a left-padded batch: one query token, keys one longer each step, a boolean padding mask."""
    b, h, g, d = shape["batch"], shape["heads"], shape["kv_heads"], shape["dim"]
    steps = []
    for length in range(shape["prompt"], shape["prompt"] + shape["steps"]):
        mask = torch.ones(b, 1, 1, length, device=device, dtype=torch.bool)
        mask[1:, ..., :3] = False  # the shorter prompts' left padding
        steps.append((torch.randn(b, h, 1, d, device=device, dtype=dtype),
                      *(torch.randn(b, g, length, d, device=device, dtype=dtype) for _ in range(2)),
                      {"attn_mask": mask}))
    return steps


def attend(query, key, value, kwargs) -> None:
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, enable_gqa=True, **kwargs)
    if query.requires_grad:
        out.sum().backward()


def timed(calls: list[tuple], device: str, backends: list | None) -> float:
    """Milliseconds a call, each call once (every shape new to the kernel), synchronised."""
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for call in calls:
            attend(*call)
        if device == "cuda":
            torch.cuda.synchronize()
    return round((time.perf_counter() - start) / len(calls) * 1000, 3)


def picks(calls: list[tuple]) -> str:
    """The kernel torch's dispatcher picks for the first call, every kernel allowed."""
    query, key, value, kwargs = calls[0]
    return SDPBackend(torch._fused_sdp_choice(query, key, value, enable_gqa=True, **kwargs)).name


def probe(dry_run: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = DRY if dry_run else FULL
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    for backends in (None, WITHOUT_CUDNN):  # the kernels' own start-up, on shapes the timed calls do not use
        timed(training_inputs({**shape, "lengths": [shape["lengths"][0] + 1]}, device, dtype), device, backends)
        timed(decode_inputs({**shape, "prompt": shape["prompt"] - 1, "steps": 1}, device, dtype), device, backends)
    for name, inputs in (("training, a new length each call", training_inputs),
                         ("decode, keys one longer each step", decode_inputs)):
        calls = inputs(shape, device, dtype)
        result[name] = {
            "torch_picks": picks(calls),
            "ms_per_call": timed(calls, device, None),
            "ms_per_call_shapes_seen": timed(calls, device, None),  # the same shapes again: a per-shape cost is gone
            "ms_per_call_without_cudnn": timed(inputs(shape, device, dtype), device, WITHOUT_CUDNN),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="small shapes on the CPU")
    print(json.dumps(probe(parser.parse_args().dry_run)))


if __name__ == "__main__":
    main()
