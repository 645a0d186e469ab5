"""Training throughput on one GPU beside LlamaFactory: tokens/s, MFU and peak memory. benchmarks/gpu.sh sets up the
environments and runs this; it can also be run directly with a python that has CUDA torch and tuneforge's deps.

    python benchmarks/gpu_bench.py [--dry-run] [--peer-python PY] [--peer-pythonpath DIR] [--assets DIR]
                                   [--work DIR] [--workloads W1,F1B] [--run-timeout SECONDS]

Workloads, each run by tuneforge then by LlamaFactory with the same keys:
W1:  LoRA SFT of SmolLM2-135M-Instruct on alpaca_en_demo (benchmarks/train_throughput.py's W1: 256 samples,
     cutoff 512, batch 4, 30 steps, rank 8 on all linear layers, gradient checkpointing on), on the built-in
     weights when they are in TUNEFORGE_HOME, else on random weights of the same shape (no Hub on a GPU machine
     without network; throughput does not depend on the values).
F1B: full fine-tuning of a 1.1B-parameter Llama built from a config with random weights (TinyLlama-1.1B's shape:
     hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632; SmolLM2's 49152-token vocabulary, tied embeddings) on
     alpaca_en_demo: 1000 samples, cutoff 1024, batch 16, 60 steps, lr 1e-5, gradient checkpointing off.
Both in bf16 (fp32 master weights for what trains), attention fa2 when flash-attn is installed in that system's
python, else sdpa; tuneforge runs padding-free micro-batches (varlen), LlamaFactory padded ones (its default);
enable_liger_kernel where liger-kernel is installed (each system's own python; the JSON says which).

MFU = flops_per_token x effective tokens/s / the GPU's dense bf16 peak (PEAK_TFLOPS by torch.cuda.get_device_name,
or TUNEFORGE_PEAK_TFLOPS). flops_per_token counts the matrix products of the model's linear layers (N = their
weights, the LM head included, the embedding lookup not): 6N for full fine-tuning, 4N for LoRA (frozen weights get
no weight gradient); attention scores and gradient checkpointing's recomputation are not counted (MFU, not HFU).
LlamaFactory's effective tokens/s is its dataset's mean length x samples/s, so its MFU counts the trained samples
at that length; the tokens/s ratio sets it beside tuneforge's run in the same definition (dataset_tokens_per_sec).
Peak memory: torch.cuda.max_memory_allocated from the start of training in both (tuneforge's
train_peak_memory_mb; LlamaFactory's through a callback in benchmarks/llamafactory_peer.py); the RSS on a CPU.

First, benchmarks/attention_probe.py: which sdpa kernel torch picks on the device for padding-free training calls
and for decode steps, and what cuDNN's attention costs per new shape (its figures go into the summary).

--dry-run: the same flow on the CPU with a tiny Llama for both workloads, 3 steps, bf16 where the CPU has native
bf16 (else fp32); MFU is null unless TUNEFORGE_PEAK_TFLOPS is set. Every run prints one JSON line; the last line
is a summary with every run, the ratios and the seconds each phase took. A run that fails, or takes longer than
--run-timeout seconds, prints an error row instead and the other runs go on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import attention_probe
from llamafactory_peer import peer_config, run_llamafactory
from train_throughput import DEFAULT_DATA, W1, dataset_tokens_per_sec, train_child

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".cache" / "gpu-bench"

# dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name (first match)
PEAK_TFLOPS = [
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1),
    ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0),
    ("MI300X", 1307.4), ("MI250X", 383.0),
]

# model shapes (LlamaConfig keys); the vocabulary comes from the tokenizer
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0),
    "llama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, rope_theta=10000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0),
}

F1B = {
    **W1,
    "finetuning_type": "full",
    "learning_rate": 1e-5,
    "cutoff_len": 1024,
    "max_samples": 1000,
    "per_device_train_batch_size": 16,
    "max_steps": 60,
    "logging_steps": 10,
    "disable_gradient_checkpointing": True,
}
WORKLOADS = {"W1": W1, "F1B": F1B}
# the dry run: few samples, 3 steps, every step logged
DRY = {"max_samples": 16, "per_device_train_batch_size": 2, "max_steps": 3, "logging_steps": 1}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name; TUNEFORGE_PEAK_TFLOPS overrides (any device, a CPU too)."""
    if os.environ.get("TUNEFORGE_PEAK_TFLOPS"):
        return float(os.environ["TUNEFORGE_PEAK_TFLOPS"])
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in device_name.lower()), None)


def linear_params(model_dir: Path) -> int:
    """N for MFU: the weights of the model's linear layers (the LM head included, tied or not), counted on the
    meta device from its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())


def flops_per_token(n_linear: int, finetuning_type: str) -> int:
    """Forward 2N plus backward 4N for full fine-tuning; LoRA's frozen weights skip their weight gradient (2N)."""
    return (6 if finetuning_type == "full" else 4) * n_linear


def mfu(tokens_per_sec: float | None, flops: int, peak: float | None) -> float | None:
    return round(flops * tokens_per_sec / (peak * 1e12), 4) if tokens_per_sec and peak else None


def build_model(shape: str, tokenizer_dir: Path, out: Path) -> Path:
    """A LlamaForCausalLM of `shape` with random weights (bf16) and tokenizer_dir's tokenizer, saved as a Hugging
    Face folder in out; reused when it is already there."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **SHAPES[shape], vocab_size=len(tokenizer), max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising 1B weights is fast there
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def cpu_has_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def installed(python: str, module: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec(module) is not None
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def kernel_keys(python: str, cuda: bool) -> dict:
    """The attention and fused-kernel keys for the system running under `python`."""
    if not cuda:
        return {"flash_attn": "sdpa"}
    return {"flash_attn": "fa2" if installed(python, "flash_attn") else "sdpa",
            "enable_liger_kernel": installed(python, "liger_kernel")}


class Phases:
    """Seconds per phase, reported as each ends (stderr) and in the summary."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn, *args, **kwargs):
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] = round(time.time() - start, 2)
            print(f"[gpu_bench] {name}: {self.seconds[name]:.1f} s", file=sys.stderr, flush=True)


def environment(dry_run: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not dry_run:
        sys.exit(f"no CUDA device visible to {sys.executable} (torch {torch.__version__}); on a CPU use --dry-run")
    if cuda and not torch.cuda.is_bf16_supported():
        sys.exit(f"{torch.cuda.get_device_name()} has no bf16; this benchmark measures bf16 training")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    bf16 = cuda or cpu_has_bf16()
    return {"device": name, "cuda": cuda, "bf16": bf16, "peak_tflops": peak_tflops(name), "torch": torch.__version__}


def probe_attention(dry_run: bool) -> dict:
    """attention_probe.py's figures (which sdpa kernel torch picks, cuDNN's cost per new shape); a probe that fails
    is reported, never fatal: the runs after it matter more."""
    try:
        return attention_probe.probe(dry_run)
    except Exception as failure:  # noqa: BLE001 - any failure of a private torch API is a row, not a lost GPU run
        return {"error": f"{type(failure).__name__}: {failure}"}


def resolve_assets(assets: Path | None, dataset_dir: str | None) -> tuple[Path, Path, Path | None]:
    """(tokenizer folder, dataset_dir, the built-in model's folder or None): from --assets (what `gpu.sh --pack`
    wrote) or the project's own cache and ../shared; a clear exit naming what is missing."""
    from tuneforge.model.hub import BUILTIN_NAME
    from tuneforge.paths import tuneforge_home

    builtin = tuneforge_home() / "models" / BUILTIN_NAME
    builtin = builtin if (builtin / "model.safetensors").is_file() else None
    tokenizer = assets / "tokenizer" if assets else builtin
    data = Path(dataset_dir) if dataset_dir else (assets / "data" if assets else DEFAULT_DATA)
    if tokenizer is None or not (tokenizer / "tokenizer.json").is_file():
        sys.exit("no tokenizer: the built-in model is not in TUNEFORGE_HOME and no --assets folder was given; run "
                 "`benchmarks/gpu.sh --pack` on a machine with the project set up and bring .cache/gpu-bench/assets")
    if not (data / "dataset_info.json").is_file():
        sys.exit(f"no LlamaFactory demo data at {data} (dataset_info.json + alpaca_en_demo.json): pass --dataset-dir "
                 "or `benchmarks/gpu.sh --pack` them into the assets folder")
    return tokenizer, data, builtin


def attempt(phases: Phases, name: str, fn, *args, **kwargs) -> tuple[object, str | None]:
    """(fn's result, None), or (None, the message it exited with): a run that fails or runs past --run-timeout
    becomes an error row, and the runs after it still run (a GPU's time is scarce)."""
    try:
        return phases.run(name, fn, *args, **kwargs), None
    except SystemExit as failure:
        print(f"[gpu_bench] {name} failed: {failure.code}", file=sys.stderr, flush=True)
        return None, str(failure.code)


def run_pair(name: str, workload: dict, model: Path, env: dict, args, phases: Phases) -> list[dict]:
    """tuneforge then (unless skipped) LlamaFactory on one workload: their JSON lines."""
    n_linear = linear_params(model)
    flops = flops_per_token(n_linear, workload["finetuning_type"])
    common = {"workload": name, "model": str(model), "linear_params": n_linear, "flops_per_token": flops,
              "device": env["device"], "precision": "bf16" if env["bf16"] else "fp32"}
    cfg = {**workload, "model_name_or_path": str(model), "dataset_dir": str(args.dataset_dir), "bf16": env["bf16"]}
    if args.dry_run:
        cfg.update(DRY)
    rows = []
    ours_keys = kernel_keys(sys.executable, env["cuda"])
    runs = args.work / "runs"  # beside the peer's runs
    runs.mkdir(parents=True, exist_ok=True)
    ours, error = attempt(phases, f"{name} tuneforge", train_child, {**cfg, **ours_keys}, name.lower(), parent=runs,
                          timeout=args.run_timeout)
    if error:
        rows.append({"system": "tuneforge", **common, **ours_keys, "error": error})
    else:
        out, res, wall, _ = ours
        rows.append(result_row("tuneforge", common, ours_keys, env, res.get("train_tokens_per_second"),
                               res.get("train_samples_per_second"), res.get("train_runtime"), res.get("train_loss"),
                               res.get("train_peak_memory_mb"), wall, out))
        rows[-1]["dataset_tokens_per_sec"] = dataset_tokens_per_sec(out, res)  # LlamaFactory's definition
    print(json.dumps(rows[-1]), flush=True)
    if args.peer_python:
        peer_keys = kernel_keys(args.peer_python, env["cuda"])
        peer_out = runs / f"peer-{name.lower()}-{time.strftime('%H%M%S')}"
        env_vars = {"PYTHONPATH": args.peer_pythonpath} if args.peer_pythonpath else {}
        peer, error = attempt(phases, f"{name} llamafactory", run_llamafactory, args.peer_python,
                              peer_config({**cfg, **peer_keys}, peer_out, cpu=not env["cuda"]), peer_out, env_vars,
                              timeout=args.run_timeout)
        if error:
            rows.append({"system": "llamafactory-0.9.5", **common, **peer_keys, "error": error})
        else:
            rows.append(result_row("llamafactory-0.9.5", common, peer_keys, env, peer["effective_tokens_per_sec"],
                                   peer["samples_per_sec"], peer["train_runtime_s"], peer["train_loss"],
                                   peer["train_peak_memory_mb"], peer["wall_s"], peer_out))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def result_row(system, common, keys, env, tokens, samples, runtime, loss, peak, wall, out) -> dict:
    return {
        "system": system, **common, **keys,
        "effective_tokens_per_sec": tokens,
        "samples_per_sec": samples,
        "train_runtime_s": runtime,
        "train_loss": loss,
        "mfu": mfu(tokens, common["flops_per_token"], env["peak_tflops"]),
        "peak_memory_mb": peak,
        "peak_memory_kind": "cuda max_memory_allocated in training" if env["cuda"] else "RSS in training",
        "wall_s": round(wall, 2),
        "out": str(out),
    }


def ratios(rows: list[dict]) -> list[dict]:
    found = []
    done = [r for r in rows if "error" not in r]
    for ours in (r for r in done if r["system"] == "tuneforge"):
        peer = next((r for r in done if r["workload"] == ours["workload"] and r is not ours), None)
        if peer is None:
            continue
        found.append({
            "workload": ours["workload"],
            # LlamaFactory's effective tokens/s is the dataset's mean length x samples/s (train_throughput.py)
            "tokens_per_sec_ratio": ratio(ours.get("dataset_tokens_per_sec") or ours["effective_tokens_per_sec"],
                                          peer["effective_tokens_per_sec"]),
            "peak_memory_ratio": ratio(ours["peak_memory_mb"], peer["peak_memory_mb"]),
            "mfu": [ours["mfu"], peer["mfu"]],
        })
    return found


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same flow on the CPU with a tiny model, 3 steps")
    parser.add_argument("--peer-python", help="a python with llamafactory==0.9.5 installed (default: skip the peer)")
    parser.add_argument("--peer-pythonpath", help="PYTHONPATH for the peer (its CPU torchaudio stand-in)")
    parser.add_argument("--assets", type=Path, help="the folder `gpu.sh --pack` wrote (tokenizer/, data/)")
    parser.add_argument("--dataset-dir", help="LlamaFactory's demo data (default: the assets' or ../shared's)")
    parser.add_argument("--work", type=Path, default=WORK, help="models and runs go here (default: %(default)s)")
    parser.add_argument("--workloads", default="W1,F1B", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--run-timeout", type=float, help="seconds each system's run may take before it is killed "
                        "and reported as an error row (default: no limit)")
    args = parser.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in names if w not in WORKLOADS]:
        sys.exit(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    started = time.time()
    phases = Phases()
    env = phases.run("setup", environment, args.dry_run)
    env["attention_probe"] = phases.run("attention probe", probe_attention, args.dry_run)
    print(f"[gpu_bench] attention: {json.dumps(env['attention_probe'])}", file=sys.stderr, flush=True)
    tokenizer, args.dataset_dir, builtin = resolve_assets(args.assets, args.dataset_dir)
    print(f"[gpu_bench] {env['device']}, peak {env['peak_tflops']} TFLOP/s bf16, torch {env['torch']}; "
          f"peer: {args.peer_python or 'skipped'}", file=sys.stderr, flush=True)
    models = args.work / "models"
    if args.dry_run:
        tiny = phases.run("build tiny model", build_model, "tiny", tokenizer, models / "tiny")
        model_of = {"W1": lambda: tiny, "F1B": lambda: tiny}
    else:  # each workload's model, built when it is asked for
        model_of = {
            "W1": lambda: builtin or phases.run("build smollm2-135m", build_model, "smollm2-135m", tokenizer,
                                                models / "smollm2-135m"),
            "F1B": lambda: phases.run("build llama-1.1b", build_model, "llama-1.1b", tokenizer,
                                      models / "llama-1.1b"),
        }
    rows = []
    for name in names:
        rows += run_pair(name, WORKLOADS[name], model_of[name](), env, args, phases)
    found = ratios(rows)
    for r in found:
        print(json.dumps(r), flush=True)
    print(json.dumps({"summary": True, "dry_run": args.dry_run, **env, "runs": rows, "ratios": found,
                      "phases_s": phases.seconds, "total_s": round(time.time() - started, 2)}), flush=True)
    if failed := [f"{r['workload']} {r['system']}" for r in rows if "error" in r]:
        sys.exit(f"failed: {', '.join(failed)} (their error rows say why)")


if __name__ == "__main__":
    main()
