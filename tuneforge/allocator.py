"""The memory allocator a CLI run uses: tcmalloc or jemalloc when one is installed, preloaded by re-running the
command once with LD_PRELOAD (the allocator must be in place before the interpreter allocates anything).

Why: glibc's malloc keeps the freed activations of one step in its heap, shaped for that step's lengths; the next
step's other shapes fit them badly and the heap grows. On W1 in fp32 (docs/performance.md) glibc ended with 4.3 GiB
peak RSS, tcmalloc and jemalloc with 2.6 GiB, at the same or better speed. Allocations of 32 MiB and more are also
fresh mmaps under glibc, each page faulted in again (a 32 MiB buffer: 15 ms fresh, 1 ms reused).

The same start also bounds oneDNN's kernel caches (`bound_kernel_caches`), which hold memory the same way.

TUNEFORGE_ALLOCATOR: "auto" (default: tcmalloc, else jemalloc, else the system's), "tcmalloc", "jemalloc" (an
error when not installed), or "system" (glibc, nothing preloaded). Linux only; a LD_PRELOAD that already names an
allocator is kept. The libraries come from the system (Debian / Ubuntu: libtcmalloc-minimal4 or libjemalloc2;
conda: gperftools or jemalloc).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from tuneforge.errors import TuneforgeError

ENV = "TUNEFORGE_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
# the library names ctypes.util.find_library looks up, best first
LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4 (Debian / Ubuntu) or gperftools (conda)",
            "jemalloc": "libjemalloc2 (Debian / Ubuntu) or jemalloc (conda)"}
# tcmalloc prints every allocation over 1 GiB to stderr by default (a large vocabulary's logits reach that)
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


# oneDNN (torch's CPU kernels for bf16 / fp16 products) keeps every product it compiled for reuse, ~0.5 MiB each, in
# two caches of 1,024 entries: its primitive cache and ideep's in front of it. A padding-free micro-batch or a prompt
# has a token count of its own, so each new count adds a kernel per product shape that is seldom reused. W1 in bf16
# grew by ~500 MiB this way (docs/performance.md). One step uses ~50 kernels, each many times: 256 entries hold a
# step's with room to spare; a cache smaller than a step's would recompile on every call (4x slower steps at 0).
KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}


def bound_kernel_caches(env: MutableMapping[str, str] | None = None) -> None:
    """Give oneDNN's kernel caches (in `env`, default this process's environment) the capacity of KERNEL_CACHES,
    where the user has not set one. oneDNN reads the variables when it first builds a kernel, so this works in a
    process that has imported torch but run no product yet."""
    env = os.environ if env is None else env
    for name, value in KERNEL_CACHES.items():
        env.setdefault(name, value)


def preload_env(env: Mapping[str, str], find: Callable[[str], str | None] = ctypes.util.find_library,
                platform: str = sys.platform) -> dict[str, str] | None:
    """The environment to re-run the command in, or None to run it as it is."""
    choice = chosen(env)
    if choice not in CHOICES:
        raise TuneforgeError(f"{ENV}={env[ENV]!r} is not one of {', '.join(CHOICES)}")
    if choice == "system" or platform != "linux" or active(env.get("LD_PRELOAD", "")):
        return None
    for name in LIBRARIES if choice == "auto" else (choice,):
        library = next((found for lib in LIBRARIES[name] if (found := find(lib))), None)
        if library:
            preload = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
            return {**QUIET, **env, "LD_PRELOAD": preload}
        if choice != "auto":
            raise TuneforgeError(f"{ENV}={choice}: the {choice} library is not installed; install "
                                 f"{PACKAGES[choice]}, or set {ENV}=auto or system")
    return None


def chosen(env: Mapping[str, str]) -> str:
    """TUNEFORGE_ALLOCATOR as written in env, normalised (unset or empty: auto); preload_env checks it."""
    return env.get(ENV, "auto").strip().lower() or "auto"


def active(preload: str | None = None) -> str | None:
    """The allocator in use: "tcmalloc" / "jemalloc" when its library is preloaded, else None (the system's)."""
    if preload is None:
        try:
            preload = Path("/proc/self/maps").read_text()
        except OSError:
            preload = os.environ.get("LD_PRELOAD", "")
    return next((name for name in LIBRARIES if f"lib{name}" in preload), None)


def describe() -> str:
    """The allocator in use, in words: "tcmalloc", "jemalloc" or "system (glibc)"."""
    return active() or "system (glibc)"


def install_advice() -> str | None:
    """What to install, when auto (Linux) found neither library; None when an allocator is in use or the system's
    was chosen on purpose."""
    if active() or sys.platform != "linux" or chosen(os.environ) != "auto":
        return None
    return (f"neither tcmalloc nor jemalloc is installed, so glibc's malloc runs: install {PACKAGES['tcmalloc']} "
            f"for a quarter to a third less peak memory in training")


def describe_kernel_caches() -> str:
    """oneDNN's kernel cache capacities as this process has them (oneDNN's own default: 1024)."""
    return ", ".join(f"{name}={os.environ.get(name, '1024 (default)')}" for name in KERNEL_CACHES)


def reexec_with_allocator() -> None:
    """Re-run this command (same interpreter, same arguments) with the allocator preloaded, when one is chosen and
    installed; returns only when nothing is to change."""
    env = preload_env(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
