"""Training throughput on the workloads that ../shared/bench/peer-llamafactory.sh gives LlamaFactory, so
the two can be set side by side in one sitting.

    python benchmarks/train_throughput.py [--workload W1|W2|W3|W4|W5] [--dataset-dir DIR] [--model-dir DIR]
                                          [--peer] [key=value ...]

W1: LoRA SFT of the built-in SmolLM2-135M-Instruct on alpaca_en_demo (the peer script's defaults).
W2: LoRA DPO of the same model on dpo_en_demo (128 pairs, cutoff 512, batch 2, 20 steps, bf16);
    `precompute_ref_log_probs=true` as an override measures the precomputed-reference variant.
W3: full fine-tuning of the same model on alpaca_en_demo (finetuning_type full, lr 1e-5, 10 steps: every weight
    trains in fp32 with bf16 autocast in both; a few minutes on 2 CPU cores).
W4: QLoRA: W1 with the base quantized to 4 bits by bitsandbytes on loading (quantization_bit 4, NF4 with double
    quantization, both systems' defaults), 10 steps. The peer script writes only its own keys, so for W4 this
    benchmark runs LlamaFactory itself (benchmarks/llamafactory_peer.py) from the peer script's venv, with the
    same keys plus quantization_bit, and installs bitsandbytes there if it is missing. bitsandbytes 4-bit runs on
    a CPU (its torch fallback: the kernels-community CPU kernels need the Hub), in both.
W5: LoRA SFT of a vision-language model on mllm_demo (its 6 rows with images, batch 2, 30 steps): by default
    the tests' tiny random LLaVA (tests/mm_families.py; LLaVA's processor loads without torchvision, which
    LlamaFactory's needs too), or --model-dir. The peer renders with its own `llava` template, tuneforge with the
    processor's chat template, so their token counts can differ slightly: compare tokens/s, not losses.

Runs `tuneforge train` in a child process (so peak RSS is the whole run's) and prints one JSON line:
effective (non-padding) tokens/s, samples/s (pairs/s for W2), train_runtime, peak RSS, final loss, the memory
allocator the run used (TUNEFORGE_ALLOCATOR=system measures glibc's). With --peer it then runs the peer script on
the same model and workload, and prints both lines and a third with the ratios. Timing is measured, never asserted.

Two tokens/s figures, because LlamaFactory's `effective_tokens_per_sec` is not a count of the tokens it trained: it
is the whole dataset's tokens x the epochs trained (a fraction when max_steps ends the run early) / runtime, i.e.
the dataset's mean length x samples/s. A run that ends after the first samples of an epoch (W1 trains 120 of 256
rows) counts them at the dataset's mean length, whatever their own. `effective_tokens_per_sec` is the tokens
tuneforge trained; `dataset_tokens_per_sec` is its run in LlamaFactory's definition, which the tokens/s ratio uses
(the same samples in the same order, from the same seed, in both).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tuneforge.workflow import loss_curve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "llamafactory"
PEER_SCRIPT = ROOT.parent / "shared" / "bench" / "peer-llamafactory.sh"

# the peer script's defaults, key for key
W1 = {
    "model_name_or_path": "smollm2-135m-instruct",
    "stage": "sft",
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_target": "all",
    "dataset": "alpaca_en_demo",
    "cutoff_len": 512,
    "max_samples": 256,
    "overwrite_cache": True,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "learning_rate": 1e-4,
    "max_steps": 30,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.1,
    "bf16": True,
    "seed": 42,
    "logging_steps": 5,
    "save_steps": 100000,
    "overwrite_output_dir": True,
    "disable_tqdm": True,
}


# W2: the same model and method, DPO on LlamaFactory's dpo_en_demo pairs
W2 = {
    **W1,
    "stage": "dpo",
    "pref_loss": "sigmoid",
    "pref_beta": 0.1,
    "dataset": "dpo_en_demo",
    "max_samples": 128,
    "per_device_train_batch_size": 2,
    "max_steps": 20,
}
# W5: multimodal SFT on LlamaFactory's mllm_demo (images), a small vision-language model
W5 = {
    **W1,
    "dataset": "mllm_demo",
    "cutoff_len": 1024,
    "max_samples": 6,
    "per_device_train_batch_size": 2,
    "max_steps": 30,
    "logging_steps": 5,
}
# W3: full fine-tuning (LlamaFactory's finetuning_type full; its example's learning rate)
W3 = {**W1, "finetuning_type": "full", "learning_rate": 1e-5, "max_steps": 10}
# W4: QLoRA, W1 on a 4-bit (NF4) base
W4 = {**W1, "quantization_bit": 4, "max_steps": 10}
WORKLOADS = {"W1": W1, "W2": W2, "W3": W3, "W4": W4, "W5": W5}
# the peer script's keys for each workload (W1 is its defaults)
PEER_ARGS = {
    "W1": [],
    "W2": ["stage=dpo", "dataset=dpo_en_demo", "max_samples=128", "batch_size=2", "max_steps=20"],
    "W3": ["finetuning_type=full", "learning_rate=1e-5", "max_steps=10"],
    "W5": ["dataset=mllm_demo", "template=llava", "cutoff_len=1024", "max_samples=6", "batch_size=2",
           "max_steps=30"],
}


def tiny_vlm(family: str = "llava") -> Path:
    """The tests' tiny random vision-language model of `family`, written to a temporary folder."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mm_families import build_family

    return build_family(family, Path(tempfile.mkdtemp(prefix=f"tiny-{family}-")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--dataset-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--model-dir", help="the model folder (default: the workload's; W5: a tiny random LLaVA)")
    parser.add_argument("--peer", action="store_true", help=f"run {PEER_SCRIPT.name} after tuneforge, then compare")
    parser.add_argument("--fp32", action="store_true",
                        help="both systems in fp32 (for CPUs without native bf16, where bf16 is emulated)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    # ours first: its peak RSS is read from RUSAGE_CHILDREN, which the peer would raise
    precision = ["bf16=false"] if args.fp32 else []
    model_dir = args.model_dir or (str(tiny_vlm()) if args.workload == "W5" else None)
    model = [f"model_name_or_path={model_dir}"] if model_dir else []
    ours = run_tuneforge(args.workload, args.dataset_dir, [*precision, *model, *args.overrides])
    if args.workload in CEILING_METHOD and not model_dir:  # the compute ceiling, measured now (matmul_probe.py)
        ours.update(compute_ceiling(ours, CEILING_METHOD[args.workload], args.fp32))
    peer = run_peer(args.workload, args.dataset_dir, precision, model_dir) if args.peer else None
    print(json.dumps(ours))
    if peer is not None:
        print(json.dumps(peer))
        print(json.dumps({
            "workload": args.workload,
            # both in LlamaFactory's definition (the module's docstring)
            "tokens_per_sec_ratio": ratio(ours["dataset_tokens_per_sec"], peer["effective_tokens_per_sec"]),
            "samples_per_sec_ratio": ratio(ours["samples_per_sec"], peer["samples_per_sec"]),
            "runtime_ratio": ratio(peer["train_runtime_s"], ours["train_runtime_s"]),
            "peak_rss_ratio": ratio(ours["peak_rss_mb"], peer["peak_rss_mb"]),
        }))


# the text workloads on the built-in model whose ceiling the matmul probe gives: their finetuning type
CEILING_METHOD = {"W1": "lora", "W3": "full", "W4": "lora"}


def compute_ceiling(ours: dict, method: str, fp32: bool) -> dict:
    """The matrix-product ceiling at the run's mean micro-batch (tokens per step), and the run's share of it."""
    import torch
    from matmul_probe import ceiling
    from transformers import AutoConfig

    from tuneforge.model.hub import builtin_model_dir

    results = json.loads((Path(ours["out"]) / "run" / "train_results.json").read_text())
    tokens = max(1, round(results["total_tokens"] / max(results["global_step"], 1)))
    probe = ceiling(AutoConfig.from_pretrained(builtin_model_dir()), tokens, torch.float32 if fp32 else torch.bfloat16,
                    method)
    share = ours["effective_tokens_per_sec"] / probe["ceiling_tokens_per_sec"] if ours["effective_tokens_per_sec"] else None
    return {"matmul_probe": probe, "ceiling_fraction": round(share, 3) if share else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def run_peer(workload: str, dataset_dir: str, extra: list[str], model_dir: str | None = None) -> dict:
    """LlamaFactory on the workload, on model_dir (default: the built-in model's folder); samples/s from its
    train_results."""
    from tuneforge.model.hub import builtin_model_dir

    model = model_dir or str(builtin_model_dir())
    if workload not in PEER_ARGS:  # a key the peer script cannot pass
        return run_peer_direct(workload, dataset_dir, extra, model)
    cmd = ["bash", str(PEER_SCRIPT), model, f"dataset_dir={dataset_dir}", *PEER_ARGS[workload], *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the peer failed ({done.returncode}):\n{done.stderr[-2000:]}")
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    results = Path(peer["out"]) / "run" / "train_results.json"
    peer["samples_per_sec"] = json.loads(results.read_text()).get("train_samples_per_second") if results.is_file() else None
    return peer


def run_peer_direct(workload: str, dataset_dir: str, extra: list[str], model: str) -> dict:
    """LlamaFactory on the workload's own keys, from the peer script's venv (with its CPU work-arounds)."""
    from llamafactory_peer import peer_config, peer_venv, run_llamafactory

    quantized = "quantization_bit" in WORKLOADS[workload]
    venv = peer_venv(model, installed="import bitsandbytes" if quantized else "",
                     packages=("bitsandbytes>=0.46,<0.51",))
    python = venv / "bin" / "python"
    keys = dict(kv.split("=", 1) for kv in extra)  # --fp32's bf16=false
    cfg = {**WORKLOADS[workload], "model_name_or_path": model, "dataset_dir": dataset_dir,
           **{k: json.loads(v) for k, v in keys.items()}}
    out = Path(os.environ.get("PEER_OUT") or tempfile.mkdtemp(prefix=f"peer-{workload.lower()}-"))
    # the peer script's CPU work-around: an empty torchaudio stand-in that LlamaFactory imports
    res = run_llamafactory(str(python), peer_config(cfg, out, cpu=True), out, env={"PYTHONPATH": str(venv / "stubs")})
    return {"system": "llamafactory-0.9.5", "workload": workload, **res}


def train_child(cfg: dict, workload: str, overrides: list[str] = (), parent: Path | None = None,
                timeout: float | None = None) -> tuple[Path, dict, float, float]:
    """`tuneforge train` on cfg in a child process, its outputs in a new folder's run/ (in `parent`, else the system's
    temporary folder): (that folder, train_results.json, wall seconds, the children's peak RSS in MiB). Exits naming
    the log if it fails or runs past `timeout` seconds (then it is killed)."""
    out = Path(tempfile.mkdtemp(prefix=f"tuneforge-{workload.lower()}-", dir=parent))
    cfg = {**cfg, "output_dir": str(out / "run")}
    (out / "workload.json").write_text(json.dumps(cfg, indent=2))
    cmd = [sys.executable, "-m", "tuneforge.cli", "train", str(out / "workload.json"), *overrides]
    start = time.time()
    with open(out / "log.txt", "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            sys.exit(f"tuneforge did not finish within {timeout:g} s; see {out / 'log.txt'}")
    wall = time.time() - start
    if code != 0:
        sys.exit(f"tuneforge failed ({code}); see {out / 'log.txt'}")
    results = json.loads((out / "run" / "train_results.json").read_text())
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # kilobytes on Linux
    return out, results, wall, peak_kb / 1024


def run_tuneforge(workload: str, dataset_dir: str, overrides: list[str]) -> dict:
    cfg = {**WORKLOADS[workload], "dataset_dir": dataset_dir}
    out, res, wall, peak_mb = train_child(cfg, workload, overrides)
    curve = loss_curve(out / "run")
    return {
        "system": "tuneforge",
        "workload": workload,
        "effective_tokens_per_sec": res.get("train_tokens_per_second"),
        "dataset_tokens_per_sec": dataset_tokens_per_sec(out, res),
        "samples_per_sec": res.get("train_samples_per_second"),
        "train_runtime_s": res.get("train_runtime"),
        "train_loss": res.get("train_loss"),
        "first_loss": curve.get("first_loss"),
        "final_loss": curve.get("last_loss"),
        "peak_rss_mb": round(peak_mb, 1),
        "wall_s": round(wall, 2),
        "allocator": logged_allocator(out / "log.txt"),
        "out": str(out),
    }


def dataset_tokens_per_sec(out: Path, results: dict) -> float | None:
    """The run's tokens/s in LlamaFactory's definition: the train split's mean length x samples/s."""
    data, samples_per_sec = logged_data(out / "log.txt"), results.get("train_samples_per_second")
    if not (data.get("train_tokens") and data.get("train_samples") and samples_per_sec):
        return None
    return round(data["train_tokens"] / data["train_samples"] * samples_per_sec, 3)


def logged_data(log: Path) -> dict[str, int]:
    """The train split's size from the run's "data: key=value, ..." line (samples and tokens after truncation)."""
    for line in log.read_text().splitlines():
        if "INFO tuneforge.workflow: data: " in line:
            pairs = (item.split("=", 1) for item in line.split("data: ", 1)[1].split(", "))
            return {k: int(v) for k, v in pairs if k in ("train_samples", "train_tokens")}
    return {}


def logged_allocator(log: Path) -> str | None:
    """The memory allocator the run logged (tuneforge/allocator.py: TUNEFORGE_ALLOCATOR picks it)."""
    marker = "memory allocator: "
    lines = [line for line in log.read_text().splitlines() if marker in line]
    return lines[0].split(marker, 1)[1].strip() if lines else None


if __name__ == "__main__":
    main()
