"""The process heap's settings (serving.heap): each step's activations reuse freed heap blocks."""

from __future__ import annotations

import pytest
from checks import printed_under

# mallinfo2's first fields (malloc.h): arena, ordblks, smblks, hblks, hblkhd, usmblks, fsmblks,
# uordblks, fordblks, keepcost. hblkhd: bytes in mmapped blocks; keepcost: the free heap top.
HEAP_CHECK = """
import ctypes, torch
from serving.heap import keep_freed_blocks

class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if KEPT:
    print(keep_freed_blocks())
mapped = libc.mallinfo2().hblkhd
block = torch.ones(30 << 18)  # 30 MiB: glibc's first such block is mmapped, and unmapped when freed
print(libc.mallinfo2().hblkhd - mapped >= 30 << 20)
del block
print(libc.mallinfo2().keepcost >= 30 << 20)
"""


@pytest.mark.parametrize("kept", [True, False])
def test_large_blocks_come_from_the_heap_and_stay_there_once_kept(kept: bool) -> None:
    """After keep_freed_blocks, a 30 MiB block comes from the heap (not mmap) and, freed, stays
    as its free top for the next step; glibc's defaults map it and give it back."""
    expected = ["True", "False", "True"] if kept else ["True", "False"]
    assert printed_under({}, f"KEPT = {kept}" + HEAP_CHECK) == expected
