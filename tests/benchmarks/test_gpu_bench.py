"""benchmarks/gpu.sh and its driver: how MFU is counted, the GPU table, LlamaFactory's config on a GPU vs a CPU, the
errors a user sees before anything runs, and (e2e) the dry run's JSON on an offline machine's setup."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bench  # noqa: E402
from llamafactory_peer import peer_config, run_llamafactory  # noqa: E402
from train_throughput import train_child  # noqa: E402


def test_peak_by_device_name(monkeypatch):
    monkeypatch.delenv("TUNEFORGE_PEAK_TFLOPS", raising=False)
    assert gpu_bench.peak_tflops("NVIDIA H200") == 989.4
    assert gpu_bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_bench.peak_tflops("NVIDIA L40S") == 362.1
    assert gpu_bench.peak_tflops("cpu") is None
    monkeypatch.setenv("TUNEFORGE_PEAK_TFLOPS", "0.4")
    assert gpu_bench.peak_tflops("cpu") == 0.4


def test_flops_count_the_linear_weights_lm_head_included(tiny_model_dir, tokenizer):
    # tiny_model_dir: hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads; tied embeddings
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * 32 * 64
    n = 2 * per_layer + len(tokenizer) * 32
    assert gpu_bench.linear_params(tiny_model_dir) == n
    assert gpu_bench.flops_per_token(n, "full") == 6 * n
    assert gpu_bench.flops_per_token(n, "lora") == 4 * n
    assert gpu_bench.mfu(1000.0, 6 * n, 989.4) == round(6 * n * 1000 / 989.4e12, 4)
    assert gpu_bench.mfu(1000.0, 6 * n, None) is None


def test_llamafactory_config_on_gpu_and_cpu(tmp_path):
    workload = {**gpu_bench.F1B, "model_name_or_path": "/m", "flash_attn": "fa2", "enable_liger_kernel": True}
    gpu = peer_config(workload, tmp_path, cpu=False)
    assert "use_cpu" not in gpu and gpu["flash_attn"] == "fa2" and gpu["enable_liger_kernel"] is True
    assert gpu["finetuning_type"] == "full" and gpu["per_device_train_batch_size"] == 16
    assert gpu["disable_gradient_checkpointing"] is True and gpu["output_dir"] == str(tmp_path / "run")
    assert gpu["do_train"] is True and gpu["include_effective_tokens_per_second"] is True
    assert "disable_tqdm" not in gpu
    cpu = peer_config({**workload, "quantization_bit": 4}, tmp_path, cpu=True)
    assert cpu["use_cpu"] is True and cpu["quantization_bit"] == 4


def test_ratios_pair_each_workload():
    rows = [
        {"system": "tuneforge", "workload": "W1", "effective_tokens_per_sec": 300.0, "peak_memory_mb": 600.0, "mfu": 0.3},
        {"system": "llamafactory-0.9.5", "workload": "W1", "effective_tokens_per_sec": 100.0, "peak_memory_mb": 1000.0,
         "mfu": 0.1},
        {"system": "tuneforge", "workload": "F1B", "effective_tokens_per_sec": 5.0, "peak_memory_mb": 1.0, "mfu": None},
    ]
    assert gpu_bench.ratios(rows) == [{"workload": "W1", "tokens_per_sec_ratio": 3.0, "peak_memory_ratio": 0.6,
                                       "mfu": [0.3, 0.1]}]
    # where tuneforge's run has its tokens/s in LlamaFactory's definition, the ratio uses that
    rows[0]["dataset_tokens_per_sec"] = 320.0
    assert gpu_bench.ratios(rows)[0]["tokens_per_sec_ratio"] == 3.2


def test_a_failed_run_is_an_error_row_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    """On a scarce GPU one run's failure (or timeout) must not cost the others: tuneforge's run fails here, and
    LlamaFactory's still runs, with the same --run-timeout; no ratio is made from the failed pair."""
    calls = []

    def failing(cfg, workload, overrides=(), parent=None, timeout=None):
        calls.append(("tuneforge", timeout))
        sys.exit(f"tuneforge did not finish within {timeout:g} s; see log.txt")

    def peer(python, cfg, out, env=None, timeout=None):
        calls.append(("llamafactory", timeout))
        return {"effective_tokens_per_sec": 100.0, "samples_per_sec": 0.5, "train_runtime_s": 9.0, "train_loss": 1.0,
                "train_peak_memory_mb": 900.0, "wall_s": 12.0}

    monkeypatch.setattr(gpu_bench, "train_child", failing)
    monkeypatch.setattr(gpu_bench, "run_llamafactory", peer)
    monkeypatch.setattr(gpu_bench, "linear_params", lambda model: 10)
    args = SimpleNamespace(dry_run=False, dataset_dir=tmp_path, work=tmp_path, peer_python=sys.executable,
                           peer_pythonpath=None, run_timeout=60.0)
    env = {"device": "NVIDIA H100", "cuda": True, "bf16": True, "peak_tflops": 989.4}
    rows = gpu_bench.run_pair("W1", gpu_bench.W1, tmp_path, env, args, gpu_bench.Phases())
    assert calls == [("tuneforge", 60.0), ("llamafactory", 60.0)]
    assert rows[0]["system"] == "tuneforge" and rows[0]["error"] == "tuneforge did not finish within 60 s; see log.txt"
    assert rows[1]["effective_tokens_per_sec"] == 100.0 and "error" not in rows[1]
    assert gpu_bench.ratios(rows) == []
    assert "[gpu_bench] W1 tuneforge failed: tuneforge did not finish within 60 s" in capsys.readouterr().err


def test_a_failed_attention_probe_is_reported_not_fatal(monkeypatch):
    def missing(dry_run):
        raise AttributeError("module 'torch' has no attribute '_fused_sdp_choice'")

    monkeypatch.setattr(gpu_bench.attention_probe, "probe", missing)
    assert gpu_bench.probe_attention(False) == {
        "error": "AttributeError: module 'torch' has no attribute '_fused_sdp_choice'"}


def test_runs_past_their_timeout_are_killed_and_named(tmp_path):
    with pytest.raises(SystemExit, match=r"tuneforge did not finish within 0.5 s; see .*log.txt"):
        train_child({"stage": "sft"}, "W1", parent=tmp_path, timeout=0.5)
    python = tmp_path / "slow-python"
    python.write_text("#!/bin/sh\nexec sleep 30\n")
    python.chmod(0o755)
    with pytest.raises(SystemExit, match=r"llamafactory did not finish within 0.5 s; see .*log.txt"):
        run_llamafactory(str(python), {}, tmp_path / "peer", timeout=0.5)


def test_unknown_workload_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--dry-run", "--workloads", "W1,W9"])
    with pytest.raises(SystemExit, match="unknown workload.*W9.*W1, F1B"):
        gpu_bench.main()


def test_gpu_sh_names_a_python_that_cannot_run_it(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"], capture_output=True, text=True,
                          env={**os.environ, "TUNEFORGE_PYTHON": str(tmp_path / "nope"), "GPU_BENCH_WORK": str(tmp_path)})
    assert done.returncode == 2
    assert f"TUNEFORGE_PYTHON={tmp_path / 'nope'} does not import torch" in done.stderr


def write_wheel(folder: Path, name: str) -> None:
    """A pure-Python wheel of one empty module `name`."""
    folder.mkdir(parents=True)
    info = f"{name}-0.1.dist-info"
    files = {f"{name}.py": "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.mark.e2e
def test_dry_run_prints_every_figure(tmp_path, tokenizer, lf_data_dir):
    """As on a GPU machine without network: a python that has torch and the stack but not tuneforge installed (the
    site-packages on its path without their .pth files, so no editable install), and the folder `--pack` writes
    (the tokenizer, LlamaFactory's demo data, wheels for this python, installed before anything runs)."""
    work = tmp_path / "work"
    assets = work / "assets"
    tokenizer.save_pretrained(assets / "tokenizer")
    (assets / "data").mkdir()
    shutil.copy(lf_data_dir / "alpaca_en_demo.json", assets / "data")
    info = json.loads((lf_data_dir / "dataset_info.json").read_text())
    (assets / "data" / "dataset_info.json").write_text(json.dumps({"alpaca_en_demo": info["alpaca_en_demo"]}))
    write_wheel(assets / "wheels" / f"cp{sys.version_info[0]}{sys.version_info[1]}" / "ours", "packed_probe")
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{sysconfig.get_paths()["purelib"]}" '
                      f'exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "TUNEFORGE_PYTHON": str(python), "GPU_BENCH_WORK": str(work), "TUNEFORGE_PEAK_TFLOPS": "0.4"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--no-peer"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tuneforge: {python} (with {work / 'site-ours'})" in done.stderr
    assert (work / "site-ours" / "packed_probe.py").is_file()
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["dry_run"] is True and summary["device"] == "cpu" and summary["peak_tflops"] == 0.4
    assert [(r["system"], r["workload"]) for r in summary["runs"]] == [("tuneforge", "W1"), ("tuneforge", "F1B")]
    n = 2 * (64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 128) + len(tokenizer) * 64  # the "tiny" shape
    for run, factor in zip(summary["runs"], (4, 6), strict=True):
        assert run["linear_params"] == n and run["flops_per_token"] == factor * n
        assert run["effective_tokens_per_sec"] > 0 and run["train_runtime_s"] > 0 and run["peak_memory_mb"] > 0
        assert run["dataset_tokens_per_sec"] > 0  # read from the run's data line, for the ratio to LlamaFactory
        assert run["mfu"] == round(factor * n * run["effective_tokens_per_sec"] / 0.4e12, 4)
        assert run["peak_memory_kind"] == "RSS in training" and run["flash_attn"] == "sdpa"
        assert Path(run["out"]).parent == work / "runs"  # in the work folder, beside the peer's: none left in /tmp
    assert set(summary["phases_s"]) == {"setup", "attention probe", "build tiny model", "W1 tuneforge",
                                        "F1B tuneforge"}
    assert "[gpu_bench] W1 tuneforge:" in done.stderr
    probe = summary["attention_probe"]  # which sdpa kernel torch picks, and a call's cost with and without cuDNN's
    for pattern in ("training, a new length each call", "decode, keys one longer each step"):
        assert probe[pattern]["torch_picks"] == "FLASH_ATTENTION"  # a CPU's; on a GPU the answer the probe is for
        assert probe[pattern]["ms_per_call"] > 0 and probe[pattern]["ms_per_call_without_cudnn"] > 0
