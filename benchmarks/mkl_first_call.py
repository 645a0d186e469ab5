"""How often a fresh process's first MKL vector-math call is wrong, with and without tuneforge's warm-up.

    python benchmarks/mkl_first_call.py [--processes 120] [--block 60]

Each process computes six float functions of a [1, 143, 64] tensor (the shape of a rotary embedding's angles) on
torch's threads, twice, and reports the functions whose first result differs from the second (a low-accuracy kernel
chosen in a first call's race, pytorch/pytorch#188792; model/mkl_warmup.py). Blocks of processes alternate between
"plain" and "warmed" (settle_vml_dispatch first), so both see the same machine. Prints one JSON line. A count, never
asserted: the race depends on the machine, its load and the MKL build.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = ("cos", "sin", "exp", "log1p", "sqrt", "tanh")
SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
if {warm}:
    from tuneforge.model.mkl_warmup import settle_vml_dispatch
    settle_vml_dispatch()
x = torch.linspace(0, 140, 143 * 64).reshape(1, 143, 64)
first = {{name: getattr(x, name)() for name in {functions!r}}}
print(json.dumps([name for name, value in first.items() if not torch.equal(value, getattr(x, name)())]))
"""


def wrong_first_calls(warm: bool) -> list[str]:
    code = SCRIPT.format(root=str(ROOT), warm=warm, functions=FUNCTIONS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=120, help="fresh processes of each kind")
    parser.add_argument("--block", type=int, default=60, help="processes in a row of one kind")
    args = parser.parse_args()
    import torch

    report = {kind: {"processes": 0, "wrong": 0, "functions": Counter()} for kind in ("plain", "warmed")}
    while any(r["processes"] < args.processes for r in report.values()):
        for kind, r in report.items():
            for _ in range(min(args.block, args.processes - r["processes"])):
                wrong = wrong_first_calls(warm=kind == "warmed")
                r["processes"] += 1
                r["wrong"] += bool(wrong)
                r["functions"].update(wrong)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "mkl": torch.backends.mkl.is_available(), **report}))


if __name__ == "__main__":
    main()
