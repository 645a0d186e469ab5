"""Half-precision attention on a CPU: torch's bf16 flash kernel against tuneforge's padding-free path (fp32 kernel).

    python benchmarks/cpu_attention.py [--lengths 32 64 100 ...] [--repeat 15] [--threads N]

For each sequence length, one causal sequence at W1's shapes (SmolLM2-135M: 9 query and 3 key-value heads of 64,
bf16 inputs laid out as the model hands them over): the median milliseconds of a forward and backward through
`F.scaled_dot_product_attention` in bf16 and through tuneforge's `packed_sdpa_attention_forward`, and each one's
gradients' relative error against fp64 (q / k / v). Prints one JSON object; docs/performance.md is written from it.
Timing is measured, never asserted; compare figures only within one sitting.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tuneforge.model import attention

HEADS, KV_HEADS, DIM = 9, 3, 64
LENGTHS = [32, 64, 100, 160, 200, 300, 482, 700, 1024]


def inputs(length: int, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(1, length, heads, DIM, generator=generator).to(torch.bfloat16).transpose(1, 2)
            for heads in (HEADS, KV_HEADS, KV_HEADS)]


def torch_bf16(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def tuneforge(q, k, v):
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    bounds = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    return attention.packed_sdpa_attention_forward(module, q, k, v, None, cu_seq_lens_q=bounds)[0].transpose(1, 2)


def gradients(fn, tensors, grad):
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    fn(*leaves).backward(grad)
    return [leaf.grad for leaf in leaves]


def median_ms(fn, tensors, grad, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        gradients(fn, tensors, grad)
        times.append(time.perf_counter() - start)
    return round(sorted(times)[len(times) // 2] * 1000, 3)


def measure(length: int, repeat: int) -> dict:
    generator = torch.Generator().manual_seed(length)
    tensors = inputs(length, generator)
    grad = torch.randn(1, HEADS, length, DIM, generator=generator).to(torch.bfloat16)
    exact = gradients(torch_bf16, [t.double() for t in tensors], grad.double())
    row = {"length": length}
    for name, fn in (("torch_bf16", torch_bf16), ("tuneforge", tuneforge)):
        got = gradients(fn, tensors, grad)
        row[name] = {"ms": median_ms(fn, tensors, grad, repeat),
                     "grad_error_qkv": [round(float((g.double() - e).norm() / e.norm()), 5)
                                        for g, e in zip(got, exact, strict=True)]}
    row["speedup"] = round(row["torch_bf16"]["ms"] / row["tuneforge"]["ms"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(n, args.repeat) for n in args.lengths]
    print(json.dumps({"threads": torch.get_num_threads(), "heads": [HEADS, KV_HEADS, DIM], "rows": rows}))


if __name__ == "__main__":
    main()
