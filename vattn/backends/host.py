"""Linux virtual memory as the KV cache's page table: the host analogue of the CUDA VMM calls.

reserve = mmap(PROT_NONE, MAP_NORESERVE); physical pages = ranges of one memfd;
map = mmap(MAP_SHARED | MAP_FIXED) of a memfd range over the reservation;
unmap = the reservation's own mapping put back (same flags, so the kernel merges it);
release = fallocate(PUNCH_HOLE). After fork() the child's copy of each reservation is
replaced by private zero pages, so nothing the child writes reaches the parent's pages.
"""

from __future__ import annotations

import ctypes
import os
import resource
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from vattn.backends.base import Fence, MapError, VMMBackend
from vattn.backends.host_calls import (
    LIBC,
    MADV_POPULATE_WRITE,
    MAP_ANONYMOUS,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ_WRITE,
    HostCalls,
    check_mmap,
    select_host_calls,
)
from vattn.errors import ConfigurationError

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


def free_address_space() -> tuple[int, str]:
    """Bytes of address space this process can still reserve, and the limit that sets them:
    the user address space (its top is the highest mapping, the stack's, rounded up to a power
    of two) or RLIMIT_AS, less what the process has mapped or reserved."""
    top, used = 0, 0
    with open("/proc/self/maps", "rb") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split(b" ", 1)[0].split(b"-"))
            if end < 1 << 63 and not line.rstrip().endswith(b"[vsyscall]"):
                top, used = max(top, end), used + end - start
    bits = top.bit_length()
    free, limit = (1 << bits) - used, f"the {bits}-bit user address space"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft - used < free:
        free, limit = soft - used, f"RLIMIT_AS ({soft} B)"
    return free, limit


def available_memory() -> int:
    """Bytes the kernel estimates it can give without swapping (/proc/meminfo's MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


class MapCountBudget:
    """The memory mappings promised to this process's host caches, so that together, not
    just each alone, they stay under vm.max_map_count however their pages end up mapped."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        """Reentrant: a claim allocates, the garbage collector may then finalize a dropped
        cache on this thread, and that gives its mappings back inside the claim."""
        self.promised = 0

    def claim(self, count: int, what: str) -> None:
        with self._lock:
            limit, used = max_map_count(), current_map_count()
            if used + self.promised + count + MAP_COUNT_HEADROOM > limit:
                raise ConfigurationError(
                    f"{what} could need {count} memory mappings, but vm.max_map_count is {limit}, the "
                    f"process uses {used} and its other caches may need {self.promised} more: use a "
                    "larger page_size or a smaller memory_budget (or raise vm.max_map_count)"
                )
            self.promised += count

    def give_back(self, count: int) -> None:
        with self._lock:
            self.promised -= count


MAP_COUNT_BUDGET = MapCountBudget()
os.register_at_fork(after_in_child=MAP_COUNT_BUDGET.__init__)  # a child's caches are not its own


class HostBackend(VMMBackend):
    """Pages from one memfd, mapped into PROT_NONE reservations of this process."""

    name = "host"

    def __init__(
        self, page_size: int, max_pages: int, reservations: int, reservation_bytes: int, native: bool | None
    ) -> None:
        """`reservations` ranges of `reservation_bytes` each will be reserved; a pool of at most
        `max_pages` pages. Refused at once (ConfigurationError) if the address space or
        vm.max_map_count cannot hold them."""
        super().__init__()
        granularity = os.sysconf("SC_PAGE_SIZE")
        if page_size % granularity:
            raise ValueError(f"page_size {page_size} must be a multiple of the OS page size {granularity}")
        free, limit = free_address_space()
        if reservations * reservation_bytes > free:
            raise ConfigurationError(
                f"this cache reserves {reservations} x {reservation_bytes} B of address space (every slot "
                f"at full context), but {limit} leaves {free} B: use fewer max_slots or a shorter max_context"
            )
        self.page_size = page_size
        self.calls: HostCalls = select_host_calls(native)
        # Worst case: every page mapped apart from its neighbours' pool offsets, each
        # one a mapping of its own plus the bare reservation gap that follows it.
        worst = reservations + 2 * max_pages
        MAP_COUNT_BUDGET.claim(worst, f"this cache ({max_pages} pages, {reservations} reservations)")
        self._claimed = worst
        self._reservations: dict[int, int] = {}
        self._max_pages = max_pages
        self._next_page = 0
        self._released: list[int] = []
        """Pool offsets whose pages were released (their memory punched out): created again first."""
        self._fd = -1
        try:
            self._fd = os.memfd_create("vattn-kv-pool", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, max_pages * page_size)
        except BaseException:
            self.close()
            raise

    def reserve(self, nbytes: int) -> int:
        addr = check_mmap(LIBC.mmap(None, nbytes, PROT_NONE, RESERVATION_FLAGS, -1, 0), "reserve")
        self._reservations[addr] = nbytes
        return addr

    def free_reservation(self, addr: int, nbytes: int, mapped: Sequence[int] = ()) -> None:
        """munmap of the whole range takes the pages mapped in it along (and needs no new mapping)."""
        self._reservations.pop(addr, None)
        if LIBC.munmap(addr, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap reservation: {os.strerror(err)}")

    def create_pages(self, count: int) -> list[int]:
        reused = min(count, len(self._released))
        if self._next_page + count - reused > self._max_pages:
            raise ValueError(f"pool holds {self._max_pages} pages; cannot create {count} more")
        pages = self._released[len(self._released) - reused :]
        del self._released[len(self._released) - reused :]
        pages += range(self._next_page, self._next_page + count - reused)
        self._next_page += count - reused
        return pages

    def back_pages(self, pages: Sequence[int]) -> None:
        """fallocate over each run of consecutive pages, then one write-populate of the run through
        a temporary mapping: shmem's fallocate allocates pages but leaves them to be zeroed at
        their first fault, which on a VM whose host backs memory at first touch runs at
        0.3-0.5 GB/s, paid inside the steps that first map them (a 2-core EPYC: 0.27 GB/s, 8% of
        serving_compare's c=16 level replayed in-process). Zeroed here, a page's later maps only
        fill page tables (~3.5 GB/s).
        ConfigurationError, with nothing allocated, if the machine has not that much memory available."""
        needed, available = len(pages) * self.page_size, available_memory()
        if needed > available:
            raise ConfigurationError(
                f"preallocating the KV cache's {needed} B needs more than the {available} B of memory this machine "
                "has available: lower the KV budget (or max_slots x max_context), or do not preallocate"
            )
        runs: list[list[int]] = []
        for page in sorted(pages):
            if runs and runs[-1][1] == page:
                runs[-1][1] += 1
            else:
                runs.append([page, page + 1])
        for first, end in runs:
            offset, nbytes = first * self.page_size, (end - first) * self.page_size
            try:
                os.posix_fallocate(self._fd, offset, nbytes)
            except OSError as error:
                raise ConfigurationError(
                    f"allocating {len(pages) * self.page_size} B of KV pages failed ({error.strerror}): "
                    "lower the KV budget or turn preallocation off"
                ) from error
            self._zero(offset, nbytes)

    def _zero(self, offset: int, nbytes: int) -> None:
        """Has the kernel zero a memfd range now (MADV_POPULATE_WRITE through a temporary mapping);
        a kernel without it (before 5.14) zeroes the pages at their first fault, as before."""
        addr = check_mmap(LIBC.mmap(None, nbytes, PROT_READ_WRITE, MAP_SHARED, self._fd, offset), "zero")
        try:
            LIBC.madvise(addr, nbytes, MADV_POPULATE_WRITE)
        finally:
            LIBC.munmap(addr, nbytes)

    def release_pages(self, pages: Sequence[int]) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        for page in pages:
            if LIBC.fallocate(self._fd, mode, page * self.page_size, self.page_size) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"release page {page}: {os.strerror(err)}")
            self._released.append(page)

    def map(self, addrs: Sequence[int], pages: Sequence[int]) -> None:
        offsets = [page * self.page_size for page in pages]
        done, err = self.calls.map_pages(self._fd, addrs, offsets, self.page_size)
        if done < len(addrs):
            undone, _ = self.calls.unmap_pages(addrs[:done], self.page_size, RESERVATION_FLAGS | MAP_FIXED)
            raise MapError(err, f"mapping page {done} of {len(addrs)}: {os.strerror(err)}", addrs[undone:done])

    def unmap(self, addrs: Sequence[int], fences: Sequence[Fence] = ()) -> None:
        """No fence to wait for: CPU work on these pages ended when the call that did it returned."""
        done, err = self.calls.unmap_pages(addrs, self.page_size, RESERVATION_FLAGS | MAP_FIXED)
        if done < len(addrs):
            raise OSError(err, f"unmapping page {done} of {len(addrs)}: {os.strerror(err)}")

    def populate(self, addrs: Sequence[int]) -> int:
        return self.calls.populate_pages(addrs, self.page_size)[0]

    def tensor(
        self, addr: int, nbytes: int, owner: object = None, mapped: bool = False, dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        array = (ctypes.c_uint8 * nbytes).from_address(addr)
        array.owner = owner  # type: ignore[attr-defined]  # the storage holds the array, the array its owner
        return torch.frombuffer(array, dtype=dtype)

    def pool_fd(self) -> int:
        """The memfd holding every physical page (page p at offset p * page_size)."""
        return self._fd

    def after_fork_in_child(self) -> None:
        super().after_fork_in_child()
        for addr, nbytes in self._reservations.items():
            check_mmap(LIBC.mmap(addr, nbytes, PROT_READ_WRITE, RESERVATION_FLAGS | MAP_FIXED, -1, 0), "detach")
        self._claimed = 0  # the child's budget starts empty
        self.close()  # this process's copy of the pool's fd; the parent keeps its own

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._claimed:
            MAP_COUNT_BUDGET.give_back(self._claimed)
            self._claimed = 0
