"""benchmarks/cpu_attention.py: both paths timed per length, their gradients measured against fp64."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_length_gives_both_timings_and_gradient_errors():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"), "--lengths", "16", "150",
                           "--repeat", "2"], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["length"] for row in report["rows"]] == [16, 150] and report["heads"] == [9, 3, 64]
    for row in report["rows"]:
        for name in ("torch_bf16", "tuneforge"):
            assert row[name]["ms"] > 0
            assert all(0 < error < 0.01 for error in row[name]["grad_error_qkv"])  # bf16's precision, not zero
    long = report["rows"][1]
    assert long["tuneforge"]["grad_error_qkv"][1] < long["torch_bf16"]["grad_error_qkv"][1]
