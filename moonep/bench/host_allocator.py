"""The host allocator that CPU-rank timings run under.

glibc's ``malloc`` serves a large block with ``mmap`` unless its size is below a threshold that moves at run
time (raised to the size of the last mmapped block freed, up to 32 MiB), and returns free memory at the top
of its heap to the system past a second threshold.  A training step allocates and frees tensors of a few MiB
each: which of them come back as fresh pages, and pay a page fault per 4 KiB on first touch, then depends on
the sizes that happened to be freed before.  On CPU ranks, with the Megatron-style path timed in the same
process, moonep's step took 2,000 to 6,600 page faults against the baseline's 100 to 950 at 1024 tokens, and
the element-wise ops writing into fresh pages ran up to five times slower.  Fixing both thresholds keeps
freed memory in the process: every path then reuses its pages, and the timings compare the work, not the
allocator's history.  Users of PyTorch on CPU do the same (``MALLOC_MMAP_THRESHOLD_``, jemalloc, tcmalloc).
"""
from __future__ import annotations

import ctypes
import ctypes.util

THRESHOLD = 1 << 30  # 1 GiB: blocks below it come from the heap, and the heap is trimmed only past it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def steady(mode: str) -> str:
    """``mode="steady"``: fix glibc's mmap and trim thresholds at :data:`THRESHOLD` for this process (every
    path the bench times); ``"default"``: leave the allocator alone.  Returns what the timings ran under,
    for the result's header."""
    if mode == "default":
        return "the C library's default"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to fix
        ok = False
    if not ok:
        return f"the C library's default ({name or 'no libc found'} took no mallopt)"
    return f"glibc, mmap and trim thresholds fixed at {THRESHOLD >> 20} MiB (freed memory stays in the process)"
