"""The command line as a user meets it: exit codes, messages without tracebacks, the summary."""

import importlib.util
import logging
import subprocess
import sys

import pytest
import torch

from tuneforge import __version__, logs
from tuneforge.cli import main


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tuneforge.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"tuneforge {__version__}"


def test_env_lists_versions_and_device(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "transformers " in out and "peft " in out
    assert "device " in out and "threads " in out


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA kernels' notices are kept where CUDA is")
def test_env_log_has_no_torchao_import_notices():
    r = run_cli("env")  # a fresh process: torchao is imported (through transformers) after the log is set up
    assert r.returncode == 0, r.stderr
    for notice in ("Failed to load", "Detected no triton", "is an Enum subclass"):
        assert notice not in r.stderr


def test_torchao_filters_drop_only_its_import_notices(monkeypatch):
    logs.quiet_torchao()
    logs.quiet_torchao()  # twice: one filter each
    assert sum(isinstance(f, logs._ImportNotices) for f in logging.getLogger("torchao").filters) == 1

    def shown(name, message):  # what the logger's own filters let through
        return bool(logging.getLogger(name).filter(logging.makeLogRecord({"name": name, "msg": message})))

    assert not shown("torchao", "Failed to load /x/_C_mxfp8.so: no CUDA")
    assert not shown("torchao.kernel.intmm", "Warning: Detected no triton, on systems without Triton ...")
    assert not shown("torch.utils._pytree", "<enum 'E'> is an Enum subclass and is now natively supported by ...")
    assert shown("torchao", "Skipping import of cpp extensions due to incompatible torch version")
    assert shown("torch.utils._pytree", "some other pytree warning")
    monkeypatch.setattr(logs, "_no_cuda", lambda: False)  # on a CUDA machine a kernel that fails to load shows
    assert shown("torchao", "Failed to load /x/_C_cutlass_90a.so: undefined symbol")


def test_config_error_is_one_line_without_traceback(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: smollm2-135m-instruct\ndataset: identity\noutput_dir: {tmp_path}/o\n"
                   "learnig_rate: 1.0e-4\n")
    r = run_cli("train", str(cfg))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"error: {cfg}: unknown key 'learnig_rate' — did you mean 'learning_rate'?" in r.stderr


def test_override_error_names_the_key(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: m\ndataset: identity\noutput_dir: {tmp_path}/o\n")
    r = run_cli("train", str(cfg), "lora_rank=abc")
    assert r.returncode == 2 and "key 'lora_rank': expected an integer, got 'abc'" in r.stderr


def test_overrides_may_follow_an_option(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: m\ndataset: identity\noutput_dir: {tmp_path}/o\n")
    r = run_cli("train", str(cfg), "--ask", "Who are you?", "lora_rank=abc")
    assert r.returncode == 2 and "key 'lora_rank': expected an integer, got 'abc'" in r.stderr  # read as an override
    r = run_cli("train", str(cfg), "--ask", "Who are you?", "--no-such-option")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-option" in r.stderr


def test_missing_config_file(tmp_path):
    r = run_cli("train", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "does not exist" in r.stderr
