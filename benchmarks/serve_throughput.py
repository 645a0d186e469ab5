"""Serving throughput: `tuneforge api` on the built-in model under concurrent clients of the official openai client,
beside the same server answering one request at a time (`infer_max_batch=1`) and, with --peer, LlamaFactory's
`llamafactory-cli api` (../shared/bench/peer-llamafactory-api.sh) on the same model folder.

    python benchmarks/serve_throughput.py [--clients 1,16,100] [--max-tokens 32] [--peer] [--peer-clients 16]
                                          [--dtype float32] [--port 8731]

Each load is ../shared/bench/serve-load.py URL KEY N MAX_TOKENS: N clients at once, each one greedy chat completion
of at most MAX_TOKENS tokens (a different question each), then the same N requests one after another. Servers run
one at a time, each in its own process started here and ended by its pid; the first load on a server follows a
warm-up request. Prints one JSON object: each load's tokens/s, p50 / p95 latency and errors, and the ratios: the
batched server at 16 clients against the one-at-a-time server at 16 clients, and against LlamaFactory at 16
clients. Timing is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from tuneforge.model.hub import builtin_model_dir

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT.parent / "shared" / "bench"
LOAD, PEER = BENCH / "serve-load.py", BENCH / "peer-llamafactory-api.sh"
KEY = "bench-key"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    request = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer {url}/models within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """End the server by its pid (its own process group, so a child it started goes too)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def load(url: str, clients: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, str(LOAD), url, KEY, str(clients), str(max_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve_and_load(name: str, cmd: list[str], port: int, loads: list[int], max_tokens: int, log_dir: Path) -> dict:
    url = f"http://127.0.0.1:{port}/v1"
    log = (log_dir / f"{name}.log").open("w")
    env = {**os.environ, "API_KEY": KEY}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
    try:
        wait_ready(url, proc)
        load(url, 1, 4)  # warm-up: first-call costs are not the server's throughput
        results = {}
        for clients in loads:
            results[str(clients)] = load(url, clients, max_tokens)
            print(f"{name} {clients} clients: {json.dumps(results[str(clients)])}", file=sys.stderr, flush=True)
        return results
    finally:
        stop(proc)
        log.close()


def ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not b["concurrent"]["tok_per_s"]:
        return None
    return round(a["concurrent"]["tok_per_s"] / b["concurrent"]["tok_per_s"], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,16,100", help="concurrent clients of each load on the batched server")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="tuneforge's infer_dtype (the peer loads the checkpoint as its engine does)")
    parser.add_argument("--peer", action="store_true", help=f"also load LlamaFactory's api ({PEER.name})")
    parser.add_argument("--peer-clients", default="16", help="loads on the one-at-a-time server and the peer")
    parser.add_argument("--port", type=int, default=8731)
    args = parser.parse_args()
    loads = [int(c) for c in args.clients.split(",")]
    others = [int(c) for c in args.peer_clients.split(",")]
    model = builtin_model_dir()
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    cfg = work / "serve.yaml"
    cfg.write_text(f"model_name_or_path: {model}\ninfer_dtype: {args.dtype}\nmax_new_tokens: 512\n")
    tuneforge = [sys.executable, "-m", "tuneforge.cli", "api", str(cfg), "--host", "127.0.0.1", "--port",
                 str(args.port)]
    report: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "python": platform.python_version()},
        "load": {"model": str(model), "dtype": args.dtype, "max_tokens": args.max_tokens, "temperature": 0,
                 "script": str(LOAD), "logs": str(work)},
    }
    report["batched"] = serve_and_load("batched", tuneforge, args.port, loads, args.max_tokens, work)
    report["one_at_a_time"] = serve_and_load("one_at_a_time", [*tuneforge, "infer_max_batch=1"], args.port, others,
                                             args.max_tokens, work)
    if args.peer:
        report["llamafactory"] = serve_and_load("llamafactory", ["bash", str(PEER), str(model), str(args.port), KEY],
                                                args.port, others, args.max_tokens, work)
    report["ratios"] = {
        f"{c}_clients_vs_one_at_a_time": ratio(report["batched"].get(str(c)), report["one_at_a_time"].get(str(c)))
        for c in others
    }
    if args.peer:
        report["ratios"].update({f"{c}_clients_vs_llamafactory": ratio(report["batched"].get(str(c)),
                                                                        report["llamafactory"].get(str(c)))
                                 for c in others})
    report["errors"] = {name: {c: r["concurrent"]["errors"] + r["sequential"]["errors"] for c, r in runs.items()}
                        for name, runs in report.items() if name in ("batched", "one_at_a_time", "llamafactory")}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
