"""The process heap (glibc's malloc) as a serving process wants it: freed blocks kept for the next
step, and given back to the OS only when asked (after loading, on sleep).

Each engine step allocates and frees the same large activations (a 2048-token prompt step's
gate/up product alone is 12.6 MB in bf16). glibc serves blocks above its mmap threshold with
mmap and unmaps them when freed, and trims the heap's top above its trim threshold, so every step
faults those pages in again, zero-filled by the kernel: on an AMX Xeon (2 threads) the offline
workload took 700k page faults, 320k with the settings below. vLLM's CPU build asks for TCMalloc
by LD_PRELOAD for the same reason; these are glibc's own knobs (mallopt), set in the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""mallopt's parameters (malloc.h)."""
HEAP_SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}
"""Blocks up to 32 MiB (glibc's largest threshold on 64-bit) from the heap, not mmap; up to 1 GiB
of free heap top kept; the heap grown 64 MiB at a time."""


@functools.cache
def keep_freed_blocks() -> bool:
    """Applies HEAP_SETTINGS once per process; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in HEAP_SETTINGS.items())


def return_freed_memory() -> None:
    """Gives the heap's free pages back to the OS. Loading frees GBs of temporaries (a GGUF is
    dequantized whole, fp32 projections are dropped once fused or quantized) that glibc would
    otherwise keep: 1.09 GB of RSS becomes 0.51 GB for the default GGUF."""
    gc.collect()  # a loaded model's modules refer to each other: collected, not freed by refcounts
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)
