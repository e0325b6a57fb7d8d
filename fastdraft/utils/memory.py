"""Process memory for runs that last days: the resident size the metrics report, and handing
freed heap back to the OS. glibc keeps freed small blocks in its arenas; a process that
allocates and frees thousands of tensors of varying sizes every step (the drafter worker:
samples of every length, packed batches, activations) grows its resident size that way
without holding any more live data."""

from __future__ import annotations

import ctypes
import functools
import os
import sys


def rss_mb() -> float | None:
    """Resident set size of this process in MiB (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def release_free_memory() -> bool:
    """glibc's malloc_trim(0): freed heap pages go back to the OS. False where there is no
    glibc (the call is then a no-op)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None
