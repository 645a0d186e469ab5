"""MKL's vector math functions settled once, on one thread, before a model runs.

On a CPU torch hands float32 / float64 elementwise math (cos, sin, exp, log, sqrt, tanh, ...) to MKL's vector math
library (VML), each intra-op thread calling it on its own chunk. oneMKL 2024.2, the one torch 2.13's wheels carry,
chooses each function's kernel lazily, at its first call; when that first call runs on several threads at once, one
thread can run a low-accuracy kernel over its whole chunk: errors of up to thousands of ulp, in that one call only
(pytorch/pytorch#188792, open; oneMKL 2025 no longer shows it).

Seen here in ~4 % of fresh processes (2 threads): the rotary embedding's first `cos` was off by up to 1.5e-4 on one
thread's half of the positions, so the first forward of a run differed from every later one. DPO's first step then
found its policy (the first forward) and its reference (the second, the same weights) apart by rewards of ~1e-4, where
both are exactly equal (docs/performance.md).

Calling each function once on one element settles its choice on the calling thread alone (torch runs a call that
small inline); every later call is computed exactly as it would have been.
"""

from __future__ import annotations

import functools

import torch

# torch's float functions that may reach VML (aten/src/ATen/cpu/vml.h and those it has routed there before); a
# function that does not reach it costs a microsecond here and changes nothing
FUNCTIONS = ("abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "floor",
             "lgamma", "log", "log10", "log1p", "log2", "reciprocal", "round", "rsqrt", "sin", "sinh", "sqrt", "tan",
             "tanh", "trunc")
DTYPES = (torch.float32, torch.float64)


@functools.cache
def settle_vml_dispatch() -> int:
    """Call each of FUNCTIONS once on a one-element tensor of each of DTYPES (once per process); how many calls."""
    if not torch.backends.mkl.is_available():
        return 0
    calls = 0
    for dtype in DTYPES:
        x = torch.full((1,), 0.5, dtype=dtype)  # inside every function's domain
        for name in FUNCTIONS:
            getattr(torch, name)(x)
            calls += 1
    return calls
