"""LlamaFactory on a workload whose keys ../shared/bench/peer-llamafactory.sh cannot pass (it writes only its own
known keys): QLoRA's quantization_bit, the GPU's flash_attn / enable_liger_kernel. The workload is the same dict
tuneforge trains on (the keys are LlamaFactory's names), plus what LlamaFactory needs to run it.

Two halves in one file:
- `run_llamafactory(python, workload, out, ...)`, called by benchmarks/train_throughput.py (W4) and
  benchmarks/gpu_bench.py: writes out/peer.json, runs this file under the peer's python, and returns the
  results (LlamaFactory's train_results.json, the process's peak RSS, the training's peak GPU memory).
- `python llamafactory_peer.py CONFIG.json RESULT.json`, run by the peer's python (which has llamafactory, not
  tuneforge): LlamaFactory's own `run_exp` on the config, with a callback that measures the peak memory from the
  start of training (as tuneforge's train_peak_memory_mb does: allocated CUDA memory, or the RSS on a CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PEER_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "bench" / "peer-llamafactory.sh"
PEER_VENV = Path(os.environ.get("PEER_VENV", Path.home() / ".cache" / "tuneforge-peer" / "lf-venv"))  # the script's
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the tokenizer template's


def peer_venv(model: str = "MODEL_DIR", *, installed: str = "", packages: tuple[str, ...] = ()) -> Path:
    """The peer script's venv (PEER_VENV), or exit saying how to build it. installed / packages: a module import
    line and the pip requirements that provide it, installed there when the import fails."""
    if not (PEER_VENV / "bin" / "llamafactory-cli").is_file():
        sys.exit(f"no LlamaFactory venv at {PEER_VENV}: run `bash {PEER_SCRIPT} {model}` once (it builds it), or set "
                 "PEER_VENV")
    if installed and subprocess.run([PEER_VENV / "bin" / "python", "-c", installed],
                                    capture_output=True).returncode != 0:
        print(f"peer: installing {', '.join(packages)} into {PEER_VENV}", file=sys.stderr)
        subprocess.run([PEER_VENV / "bin" / "pip", "install", "-q", "-c", PEER_VENV / "constraints.txt", *packages],
                       check=True)
    return PEER_VENV


# what LlamaFactory needs beside the workload's keys, as the peer script sets them
RUN_KEYS = {
    "do_train": True,
    "template": "smollm2",
    "preprocessing_num_workers": 1,
    "dataloader_num_workers": 0,
    "save_only_model": True,
    "report_to": "none",
    "include_effective_tokens_per_second": True,
}


def peer_config(workload: dict, out: Path, *, cpu: bool) -> dict:
    """LlamaFactory's config for `workload` (a tuneforge workload dict: LlamaFactory's key names), writing to
    out/run. On a CPU, use_cpu (LlamaFactory's bf16 needs it there); on a GPU, not."""
    cfg = {**RUN_KEYS, **workload, "output_dir": str(out / "run")}
    cfg.pop("disable_tqdm", None)  # tuneforge's log style; LlamaFactory's progress bar costs nothing
    if cpu:
        cfg["use_cpu"] = True
    return cfg


def run_llamafactory(python: str, cfg: dict, out: Path, env: dict | None = None, timeout: float | None = None) -> dict:
    """Run LlamaFactory (under `python`) on cfg; its results with peak memory and wall time. Exits naming the
    log if it fails or runs past `timeout` seconds (then it is killed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer.json").write_text(json.dumps(cfg, indent=2))
    cmd = [python, str(Path(__file__).resolve()), str(out / "peer.json"), str(out / "peak.json")]
    start = time.time()
    with open(out / "log.txt", "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out,
                                 env={**os.environ, "DISABLE_VERSION_CHECK": "1", **(env or {})})
        killed = threading.Event()
        timer = threading.Timer(timeout or 0, lambda: (killed.set(), child.kill()))
        if timeout:
            timer.start()
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage: its peak RSS alone
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped: the timer must not signal its pid
        timer.cancel()
    wall = time.time() - start
    if killed.is_set():
        sys.exit(f"llamafactory did not finish within {timeout:g} s; see {out / 'log.txt'}")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = (out / "log.txt").read_text(errors="replace")[-2000:]
        sys.exit(f"llamafactory failed ({code}); see {out / 'log.txt'}:\n{tail}")
    results = json.loads((out / "run" / "train_results.json").read_text())
    peak = json.loads((out / "peak.json").read_text())
    tokens = results.get("effective_tokens_per_sec")
    return {
        "effective_tokens_per_sec": round(tokens, 3) if tokens else tokens,
        "samples_per_sec": results.get("train_samples_per_second"),
        "train_runtime_s": results.get("train_runtime"),
        "train_loss": results.get("train_loss"),
        "train_peak_memory_mb": peak.get("train_peak_memory_mb"),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # kilobytes on Linux
        "wall_s": round(wall, 2),
        "out": str(out),
    }


def _train(config_path: str, result_path: str) -> None:
    """Inside the peer's python: LlamaFactory's run_exp with a training-peak-memory callback."""
    import torch
    from llamafactory.train.tuner import run_exp
    from transformers import TrainerCallback

    def peak_mb() -> float | None:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None

    class PeakMemory(TrainerCallback):
        peak: float | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            else:  # "5" resets the resident set's high-water mark to the current size (Linux)
                Path("/proc/self/clear_refs").write_text("5")

        def on_train_end(self, args, state, control, **kwargs):
            PeakMemory.peak = peak_mb()

    run_exp(json.loads(Path(config_path).read_text()), callbacks=[PeakMemory()])
    peak = PeakMemory.peak
    Path(result_path).write_text(json.dumps({"train_peak_memory_mb": round(peak, 1) if peak else None}))


if __name__ == "__main__":
    sys.path.pop(0)  # benchmarks/ itself: its scripts' names must not shadow a module LlamaFactory imports
    _train(*sys.argv[1:3])
