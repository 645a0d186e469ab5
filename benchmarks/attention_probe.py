"""Which sdpa kernel torch picks on this device, and what a call costs with it and without cuDNN's attention.

On an H100 (torch 2.11) cuDNN's attention built an execution graph for each new shape: ~2.3 ms of CPU a call, and
padding-free training brings new lengths at every step (docs/performance.md). tuneforge's padding-free attention
has run without cuDNN's kernel since. Generation has the same pattern: each decode step's keys are one longer, under
a padding mask. This probe times both patterns with torch's own choice and without cuDNN's kernel, so one GPU run
says whether generation needs the same treatment. benchmarks/gpu_bench.py runs it first; alone:

    python benchmarks/attention_probe.py [--dry-run]

Prints one JSON object: per pattern, the kernel torch picks (`torch._fused_sdp_choice`) and milliseconds a call
(synchronised) for each setting. --dry-run: small shapes on the CPU, to check the flow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# a 1.1B Llama's attention (F1B): 32 query heads, 4 key-value heads of 64; lengths of alpaca rows at cutoff 1024
FULL = {"heads": 32, "kv_heads": 4, "dim": 64, "lengths": [97, 211, 64, 533, 150, 388, 1024, 77, 260, 129, 700, 180],
        "batch": 16, "prompt": 200, "steps": 32}
DRY = {"heads": 4, "kv_heads": 2, "dim": 16, "lengths": [9, 17, 12], "batch": 2, "prompt": 8, "steps": 3}


def training_calls(shape: dict, device: str, dtype: torch.dtype) -> list:
    """One causal forward and backward per sequence, each of a length not met before (as in a padding-free batch)."""
    def call(n):
        q = torch.randn(1, shape["heads"], n, shape["dim"], device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, shape["kv_heads"], n, shape["dim"], device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    return [call(n) for n in shape["lengths"]]


def decode_calls(shape: dict, device: str, dtype: torch.dtype) -> list:
    """Decode steps of a left-padded batch: one query token, keys one longer each step, a boolean padding mask."""
    def call(length):
        b, h, g, d = shape["batch"], shape["heads"], shape["kv_heads"], shape["dim"]
        q = torch.randn(b, h, 1, d, device=device, dtype=dtype)
        k, v = (torch.randn(b, g, length, d, device=device, dtype=dtype) for _ in range(2))
        mask = torch.ones(b, 1, 1, length, device=device, dtype=torch.bool)
        mask[1:, ..., :3] = False  # the shorter prompts' left padding
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return [call(shape["prompt"] + i) for i in range(shape["steps"])]


def timed(calls: list, device: str, backends: list | None) -> float:
    """Milliseconds a call, each call once (every shape new to the kernel), synchronised."""
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for call in calls:
            call()
        if device == "cuda":
            torch.cuda.synchronize()
    return round((time.perf_counter() - start) / len(calls) * 1000, 3)


def probe(dry_run: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = DRY if dry_run else FULL
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    # the kernels' own start-up, on shapes the timed calls do not use
    timed(training_calls({**shape, "lengths": [shape["lengths"][0] + 1]}, device, dtype), device, None)
    timed(decode_calls({**shape, "prompt": shape["prompt"] - 1, "steps": 1}, device, dtype), device, None)
    for name, make in (("training, a new length each call", training_calls),
                       ("decode, keys one longer each step", decode_calls)):
        result[name] = {
            "torch_picks": pick(make, shape, device, dtype),
            "ms_per_call": timed(make(shape, device, dtype), device, None),
            "ms_per_call_without_cudnn": timed(make(shape, device, dtype), device, WITHOUT_CUDNN),
        }
    return result


def pick(make, shape: dict, device: str, dtype: torch.dtype) -> str:
    """The kernel torch's dispatcher picks for that pattern's first call, every kernel allowed."""
    b, h, g, d = (1, shape["heads"], shape["kv_heads"], shape["dim"])
    if make is training_calls:
        n = shape["lengths"][0]
        q = torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, g, n, d, device=device, dtype=dtype, requires_grad=True)
        choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)
    else:
        length = shape["prompt"]
        q = torch.randn(shape["batch"], h, 1, d, device=device, dtype=dtype)
        k = torch.randn(shape["batch"], g, length, d, device=device, dtype=dtype)
        mask = torch.ones(shape["batch"], 1, 1, length, device=device, dtype=torch.bool)
        choice = torch._fused_sdp_choice(q, k, k, attn_mask=mask, enable_gqa=True)
    return SDPBackend(choice).name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="small shapes on the CPU")
    print(json.dumps(probe(parser.parse_args().dry_run)))


if __name__ == "__main__":
    main()
