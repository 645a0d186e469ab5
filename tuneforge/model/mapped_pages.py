"""Give back the pages of a weight that lies in a memory-mapped checkpoint, once nothing will read it again.

transformers maps a safetensors checkpoint whose dtype needs no conversion (private, file-backed), so its weights
are the file's pages. A page read once stays resident until the whole map goes, which is when the last tensor in
it goes. Packing a model for generation (packed_linear.py) reads every weight to make a packed copy of it: without
help the process would then hold the map's pages and the packed copies together, twice the weights (SmolLM2-135M
in fp32: ~1.7 GiB at the peak against ~1.2 GiB loaded dense). `release(tensor, kept, mappings)` tells the kernel
that the pages lying wholly inside a weight just replaced are not needed (madvise MADV_DONTNEED). A clean page of a
file-backed map would be read from the file again if touched; a page written since (an adapter merged in place)
would be lost, so pages that a kept tensor shares (a head tied to the input embeddings) are never given back.
Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4
Span = tuple[int, int]  # [start, end) byte addresses


def span(tensor: torch.Tensor) -> Span:
    """The bytes a tensor's elements may lie in: its own for a contiguous tensor, else its storage's."""
    if tensor.is_contiguous():
        return tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def file_mappings() -> list[Span]:
    """This process's mappings of regular files (/proc/self/maps), or [] where there is none to read."""
    if not sys.platform.startswith("linux"):
        return []
    spans = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    spans.append((start, end))
    except OSError:
        return []
    return spans


def release(tensor: torch.Tensor, kept: Iterable[Span], mappings: list[Span]) -> int:
    """Give back the whole pages inside `tensor` (a CPU tensor nothing will read again) when they lie in one of the
    file `mappings` and no `kept` span touches them; returns the bytes given back."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not mappings:
        return 0
    start, end = span(tensor)
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: a neighbour's bytes stay
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if first >= last or not any(a <= first and last <= b for a, b in mappings):
        return 0
    if any(a < last and first < b for a, b in kept):
        return 0
    if _madvise()(first, last - first, MADV_DONTNEED) != 0:
        logger.debug("madvise failed (errno %d): the pages stay until the checkpoint's map goes", ctypes.get_errno())
        return 0
    return last - first


@functools.cache
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise
