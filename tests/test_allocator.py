"""The CLI's memory allocator: which library is preloaded for which TUNEFORGE_ALLOCATOR, and that a real command
runs under it."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from tuneforge.allocator import ENV, active, bound_kernel_caches, preload_env
from tuneforge.errors import TuneforgeError

INSTALLED = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}


def finder(*names):
    return lambda lib: INSTALLED[lib] if lib in names else None


def test_auto_prefers_tcmalloc_then_jemalloc_then_the_system():
    assert preload_env({}, finder("tcmalloc_minimal", "jemalloc"), "linux")["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert preload_env({ENV: "auto"}, finder("jemalloc"), "linux")["LD_PRELOAD"] == "libjemalloc.so.2"
    assert preload_env({}, finder(), "linux") is None


def test_explicit_choice_wins_and_a_missing_one_says_what_to_install():
    assert preload_env({ENV: "JeMalloc"}, finder("tcmalloc_minimal", "jemalloc"), "linux")["LD_PRELOAD"] == (
        "libjemalloc.so.2")
    with pytest.raises(TuneforgeError, match="libtcmalloc-minimal4"):
        preload_env({ENV: "tcmalloc"}, finder("jemalloc"), "linux")
    with pytest.raises(TuneforgeError, match=f"{ENV}='mimalloc' is not one of auto, tcmalloc, jemalloc, system"):
        preload_env({ENV: "mimalloc"}, finder("jemalloc"), "linux")


def test_nothing_changes_for_system_elsewhere_than_linux_or_when_already_preloaded():
    everything = finder("tcmalloc_minimal", "jemalloc")
    assert preload_env({ENV: "system"}, everything, "linux") is None
    assert preload_env({}, everything, "darwin") is None
    assert preload_env({"LD_PRELOAD": "/opt/lib/libjemalloc.so.2"}, everything, "linux") is None


def test_keeps_the_users_preload_and_tcmalloc_settings_and_silences_large_allocation_reports():
    env = preload_env({"LD_PRELOAD": "libfoo.so", "PATH": "/bin"}, finder("tcmalloc_minimal"), "linux")
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libfoo.so" and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    mine = preload_env({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "1"}, finder("tcmalloc_minimal"), "linux")
    assert mine["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "1"


def test_active_reads_the_loaded_libraries():
    assert active("7f00-7f10 r-xp 0 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10") == "tcmalloc"
    assert active("/usr/lib/libc.so.6") is None


def _cli_env(choice: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV: choice}
    env.pop("LD_PRELOAD", None)
    return subprocess.run([sys.executable, "-m", "tuneforge.cli", "env"], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
def test_the_command_line_runs_under_the_chosen_allocator():
    expected = "tcmalloc" if ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc") \
        else "jemalloc" if ctypes.util.find_library("jemalloc") else None
    if expected is None:
        pytest.skip("neither tcmalloc nor jemalloc is installed (libtcmalloc-minimal4 / libjemalloc2)")
    auto = _cli_env("auto")
    assert auto.returncode == 0, auto.stderr
    assert f"allocator {expected} ({ENV}=auto)" in auto.stdout  # read from the process's own memory map
    system = _cli_env("system")
    assert f"allocator system (glibc) ({ENV}=system)" in system.stdout
    bad = _cli_env("bogus")
    assert bad.returncode == 2 and f"error: {ENV}='bogus' is not one of" in bad.stderr


def test_kernel_caches_are_bounded_where_the_user_set_nothing():
    env = {"LRU_CACHE_CAPACITY": "2048"}
    bound_kernel_caches(env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "2048"}


def test_the_command_line_bounds_the_kernel_caches():
    env = {**os.environ, "LRU_CACHE_CAPACITY": "64"}
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    run = subprocess.run([sys.executable, "-m", "tuneforge.cli", "env"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "kernel caches ONEDNN_PRIMITIVE_CACHE_CAPACITY=256, LRU_CACHE_CAPACITY=64" in run.stdout


# bf16 products of many token counts, as padding-free micro-batches have: how much the process grew (MiB)
PRODUCTS = """
import re, sys, torch
from pathlib import Path
from tuneforge.allocator import bound_kernel_caches
bound_kernel_caches()
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024
w = torch.randn(1536, 576, dtype=torch.bfloat16)
for m in range(1, 50):
    (torch.randn(m, 576, dtype=torch.bfloat16) @ w.t()) @ w
start = rss()
for m in range(50, 650):
    (torch.randn(m, 576, dtype=torch.bfloat16) @ w.t()) @ w
print(rss() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_bounded_kernel_caches_stop_the_growth_from_new_token_counts():
    from tuneforge.train.trainer import cpu_has_native_bf16

    if not cpu_has_native_bf16():
        pytest.skip("bf16 products run through oneDNN's kernels on CPUs with native bf16")

    def growth(**caches) -> float:
        env = {**os.environ, **caches}
        env.pop("LD_PRELOAD", None)
        if not caches:
            env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
            env.pop("LRU_CACHE_CAPACITY", None)
        run = subprocess.run([sys.executable, "-c", PRODUCTS], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return float(run.stdout)

    # 1,200 kernels, ~0.5 MiB each: oneDNN's default 1,024 entries keep them all, 256 entries a fifth
    unbounded = growth(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    bounded = growth()
    assert unbounded > 300 and bounded < unbounded / 2, (unbounded, bounded)


def test_without_either_library_the_log_says_what_to_install(monkeypatch):
    import tuneforge.allocator as allocator

    monkeypatch.setattr(allocator, "active", lambda preload=None: None)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setenv(ENV, "auto")
    assert allocator.describe() == "system (glibc)"
    assert allocator.install_advice().startswith("neither tcmalloc nor jemalloc is installed, so glibc's malloc runs: "
                                                 "install libtcmalloc-minimal4 (Debian / Ubuntu)")
    monkeypatch.setenv(ENV, "System ")  # chosen on purpose: nothing to advise
    assert allocator.install_advice() is None
    monkeypatch.setenv(ENV, "auto")
    monkeypatch.setattr(allocator, "active", lambda preload=None: "jemalloc")
    assert allocator.describe() == "jemalloc" and allocator.install_advice() is None
