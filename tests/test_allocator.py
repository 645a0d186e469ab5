"""The CLI's memory allocator: which library is preloaded for which TUNEFORGE_ALLOCATOR, and that a real command
runs under it."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from tuneforge.allocator import ENV, active, preload_env
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
