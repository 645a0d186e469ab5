"""benchmarks/predict_throughput.py: workload P1 runs as `tuneforge eval` with predict_with_generate, and its JSON
line carries the run's own figures."""

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import predict_throughput as pt  # noqa: E402


def test_p1_runs_and_reports_its_predictions(tiny_model_dir, lf_data_dir, home):
    cfg = {**pt.P1, "model_name_or_path": str(tiny_model_dir), "dataset_dir": str(lf_data_dir), "max_samples": 3,
           "max_new_tokens": 4, "bf16": False}
    line = pt.run_tuneforge(cfg, 2)
    saved = json.loads((Path(line["out"]) / "predict_results.json").read_text())
    assert line["system"] == "tuneforge" and line["batch_size"] == 2
    assert line["samples_per_sec"] == saved["predict_samples_per_second"] > 0
    assert line["peak_rss_mb"] > 100 and len(pt.answers(line["out"])) == 3
    shutil.rmtree(Path(line["out"]).parent)  # the benchmark's temporary folder
