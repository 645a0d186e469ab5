"""benchmarks/mkl_first_call.py: fresh processes of both kinds, counted in one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_kinds_run_in_fresh_processes_and_the_warmed_ones_are_right():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mkl_first_call.py"), "--processes", "2",
                           "--block", "1"], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plain"]["processes"] == report["warmed"]["processes"] == 2
    assert report["warmed"]["wrong"] == 0 and not report["warmed"]["functions"]
    assert 0 <= report["plain"]["wrong"] <= 2
