"""Batched mmap/madvise calls for the host backend: the C library, or ctypes as fallback.

Both report how many pages they finished and the errno that stopped them, so the
backend can roll a failed batch back exactly.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Protocol

from vattn.backends.native import load_native, u64_array

PROT_NONE = 0
PROT_READ_WRITE = 0x1 | 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MADV_POPULATE_WRITE = 23
MAP_FAILED = 2**64 - 1


class HostCalls(Protocol):
    name: str

    def map_pages(self, fd: int, addrs: Sequence[int], offsets: Sequence[int], page_size: int) -> tuple[int, int]: ...

    def unmap_pages(self, addrs: Sequence[int], page_size: int, flags: int) -> tuple[int, int]: ...

    def populate_pages(self, addrs: Sequence[int], page_size: int) -> tuple[int, int]: ...


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


LIBC = _libc()


def check_mmap(result: int | None, what: str) -> int:
    """Returns the address mmap gave, or raises OSError with errno for a failed mmap."""
    if result is None or result == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class CtypesHostCalls:
    """One libc call per page through ctypes (each call releases the GIL)."""

    name = "ctypes"

    def map_pages(self, fd: int, addrs: Sequence[int], offsets: Sequence[int], page_size: int) -> tuple[int, int]:
        flags = MAP_SHARED | MAP_FIXED
        for i, (addr, offset) in enumerate(zip(addrs, offsets, strict=True)):
            if LIBC.mmap(addr, page_size, PROT_READ_WRITE, flags, fd, offset) in (None, MAP_FAILED):
                return i, ctypes.get_errno()
        return len(addrs), 0

    def unmap_pages(self, addrs: Sequence[int], page_size: int, flags: int) -> tuple[int, int]:
        for i, addr in enumerate(addrs):
            if LIBC.mmap(addr, page_size, PROT_NONE, flags, -1, 0) in (None, MAP_FAILED):
                return i, ctypes.get_errno()
        return len(addrs), 0

    def populate_pages(self, addrs: Sequence[int], page_size: int) -> tuple[int, int]:
        for i, addr in enumerate(addrs):
            if LIBC.madvise(addr, page_size, MADV_POPULATE_WRITE) != 0:
                return i, ctypes.get_errno()
        return len(addrs), 0


class NativeHostCalls:
    """One call into libvattn_native per batch; the GIL is released for all of it."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        u64p, errp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int)
        lib.vattn_map_pages.restype = ctypes.c_long
        lib.vattn_map_pages.argtypes = [ctypes.c_int, ctypes.c_long, u64p, u64p, ctypes.c_uint64, errp]
        lib.vattn_unmap_pages.restype = ctypes.c_long
        lib.vattn_unmap_pages.argtypes = [ctypes.c_long, u64p, ctypes.c_uint64, ctypes.c_int, errp]
        lib.vattn_populate_pages.restype = ctypes.c_long
        lib.vattn_populate_pages.argtypes = [ctypes.c_long, u64p, ctypes.c_uint64, errp]
        self._lib = lib

    def map_pages(self, fd: int, addrs: Sequence[int], offsets: Sequence[int], page_size: int) -> tuple[int, int]:
        err = ctypes.c_int(0)
        done = self._lib.vattn_map_pages(
            fd, len(addrs), u64_array(addrs), u64_array(offsets), page_size, ctypes.byref(err)
        )
        return done, err.value

    def unmap_pages(self, addrs: Sequence[int], page_size: int, flags: int) -> tuple[int, int]:
        err = ctypes.c_int(0)
        done = self._lib.vattn_unmap_pages(len(addrs), u64_array(addrs), page_size, flags, ctypes.byref(err))
        return done, err.value

    def populate_pages(self, addrs: Sequence[int], page_size: int) -> tuple[int, int]:
        err = ctypes.c_int(0)
        done = self._lib.vattn_populate_pages(len(addrs), u64_array(addrs), page_size, ctypes.byref(err))
        return done, err.value


def select_host_calls(native: bool | None) -> HostCalls:
    """The C library when asked for or built (None), ctypes when asked for or missing."""
    lib = load_native(native)
    return CtypesHostCalls() if lib is None else NativeHostCalls(lib)
