"""The machine's matrix-product rate at a model's own shapes, and the training throughput it allows.

    python benchmarks/matmul_probe.py [--model-dir DIR] [--tokens 708] [--dtype bf16|fp32] [--method lora|full]

Times torch.mm at the shapes of one decoder layer and the vocabulary head for a micro-batch of --tokens tokens
(forward products; the backward's are the same shapes transposed), in this process's threads, and prints one
JSON line: the rate (GFLOP/s), the FLOPs a trained token costs (2N forward + 2N backward to the inputs for LoRA
and frozen weights, + 2N for the weights' gradients in full fine-tuning; N the parameters the products use:
decoder matrices and the head), and the ceiling in tokens/s that rate allows. train_throughput.py reports a
run's tokens/s as a fraction of it (measured in the same sitting). Attention's own products and elementwise work
are not counted, so a real run stays below the ceiling.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of each matrix product of one decoder layer of a Llama-style model, and of the head (last)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attention = [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim), (heads * head_dim, hidden)]
    return attention + [(hidden, inter), (hidden, inter), (inter, hidden)]


def probe(config, tokens: int, dtype: torch.dtype, repeats: int = 5) -> dict:
    """GFLOP/s of the model's products at `tokens` rows; FLOPs per token of one forward (2N)."""
    shapes = layer_shapes(config)
    head = (config.hidden_size, config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    operands = [(torch.randn(tokens, i, generator=generator).to(dtype), torch.randn(i, o, generator=generator).to(dtype))
                for i, o in [*shapes, head]]
    for a, b in operands:  # warm up (oneDNN picks its kernels on the first call of a shape)
        torch.mm(a, b)
    layers = config.num_hidden_layers
    flops = 0.0
    seconds = 0.0
    for index, (a, b) in enumerate(operands):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        weight = 1 if index == len(operands) - 1 else layers  # the head once, each layer product layers times
        seconds += sorted(times)[len(times) // 2] * weight
        flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1] * weight
    forward_flops_per_token = flops / tokens
    return {"gflops": round(flops / seconds / 1e9, 1), "forward_flops_per_token": forward_flops_per_token}


def ceiling(config, tokens: int, dtype: torch.dtype, method: str) -> dict:
    """The probe, and the tokens/s it allows for a training step of `method` (lora or full)."""
    measured = probe(config, tokens, dtype)
    passes = 3 if method == "full" else 2  # forward, backward to the inputs (+ to the weights, full)
    per_token = measured["forward_flops_per_token"] * passes
    return {**measured, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "method": method,
            "threads": torch.get_num_threads(), "train_gflop_per_token": round(per_token / 1e9, 3),
            "ceiling_tokens_per_sec": round(measured["gflops"] * 1e9 / per_token, 1)}


def main() -> None:
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a model folder (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=708, help="rows of each product (tokens of a micro-batch)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--method", choices=("lora", "full"), default="lora")
    args = parser.parse_args()
    if args.model_dir is None:
        from tuneforge.model.hub import builtin_model_dir

        args.model_dir = str(builtin_model_dir())
    config = AutoConfig.from_pretrained(Path(args.model_dir))
    print(json.dumps(ceiling(config, args.tokens, DTYPES[args.dtype], args.method)))


if __name__ == "__main__":
    main()
