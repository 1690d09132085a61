"""Linux virtual memory as the KV cache's page table: the host analogue of the CUDA VMM calls.

reserve = mmap(PROT_NONE, MAP_NORESERVE); physical pages = ranges of one memfd;
map = mmap(MAP_SHARED | MAP_FIXED) of a memfd range over the reservation;
unmap = the reservation's own mapping put back (same flags, so the kernel merges it);
release = fallocate(PUNCH_HOLE).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from vattn.backends.base import VMMBackend
from vattn.backends.host_calls import (
    LIBC,
    MAP_ANONYMOUS,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    PROT_NONE,
    HostCalls,
    check_mmap,
    select_host_calls,
)

RESERVATION_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_COUNT_HEADROOM = 1024
"""Mappings left for the rest of the process (torch alone holds a few hundred)."""


def max_map_count() -> int:
    return int(Path("/proc/sys/vm/max_map_count").read_text())


def current_map_count() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


class HostBackend(VMMBackend):
    """Pages from one memfd, mapped into PROT_NONE reservations of this process."""

    name = "host"

    def __init__(self, page_size: int, max_pages: int, reservations: int, native: bool | None) -> None:
        granularity = os.sysconf("SC_PAGE_SIZE")
        if page_size % granularity:
            raise ValueError(f"page_size {page_size} must be a multiple of the OS page size {granularity}")
        self._check_map_count(max_pages, reservations)
        self.page_size = page_size
        self.calls: HostCalls = select_host_calls(native)
        self._fd = os.memfd_create("vattn-kv-pool", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, max_pages * page_size)
        self._max_pages = max_pages
        self._next_page = 0

    @staticmethod
    def _check_map_count(max_pages: int, reservations: int) -> None:
        # Worst case: every page mapped apart from its neighbours' pool offsets, each
        # one a mapping of its own plus the bare reservation gap that follows it.
        worst = reservations + 2 * max_pages
        limit, used = max_map_count(), current_map_count()
        if used + worst + MAP_COUNT_HEADROOM > limit:
            raise ValueError(
                f"this cache could need {worst} memory mappings ({max_pages} pages, "
                f"{reservations} reservations) but vm.max_map_count is {limit} and the "
                f"process already uses {used}: use a larger page_size or a smaller "
                "memory_budget (or raise vm.max_map_count)"
            )

    def reserve(self, nbytes: int) -> int:
        return check_mmap(LIBC.mmap(None, nbytes, PROT_NONE, RESERVATION_FLAGS, -1, 0), "reserve")

    def free_reservation(self, addr: int, nbytes: int) -> None:
        if LIBC.munmap(addr, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap reservation: {os.strerror(err)}")

    def create_pages(self, count: int) -> list[int]:
        if self._next_page + count > self._max_pages:
            raise ValueError(f"pool holds {self._max_pages} pages; cannot create {count} more")
        pages = list(range(self._next_page, self._next_page + count))
        self._next_page += count
        return pages

    def release_pages(self, pages: Sequence[int]) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        for page in pages:
            if LIBC.fallocate(self._fd, mode, page * self.page_size, self.page_size) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"release page {page}: {os.strerror(err)}")

    def map(self, addrs: Sequence[int], pages: Sequence[int]) -> None:
        offsets = [page * self.page_size for page in pages]
        done, err = self.calls.map_pages(self._fd, addrs, offsets, self.page_size)
        if done < len(addrs):
            self.unmap(addrs[:done])
            raise OSError(err, f"mapping page {done} of {len(addrs)}: {os.strerror(err)}")

    def unmap(self, addrs: Sequence[int]) -> None:
        done, err = self.calls.unmap_pages(addrs, self.page_size, RESERVATION_FLAGS | MAP_FIXED)
        if done < len(addrs):
            raise OSError(err, f"unmapping page {done} of {len(addrs)}: {os.strerror(err)}")

    def populate(self, addrs: Sequence[int]) -> int:
        return self.calls.populate_pages(addrs, self.page_size)[0]

    def tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)

    def pool_fd(self) -> int:
        """The memfd holding every physical page (page p at offset p * page_size)."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
