"""Memory a test process gives back between the engines it builds, one after another."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_TRIM = getattr(_LIBC, "malloc_trim", None)  # glibc's; other C libraries may lack it


def release_memory() -> None:
    """Collects dropped engines' cycles, then returns glibc's free heap pages to the OS.

    Each engine's model (~0.5 GB in fp32) is freed into the malloc arena of the thread that
    loaded it, and glibc keeps most of it there: without this the process grew by ~0.35 GB
    per server stopped, past 4.7 GB over the suite."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
