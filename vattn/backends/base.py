"""The virtual-memory primitives a KV cache needs, small enough for Linux and CUDA alike."""

from __future__ import annotations

import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class MapError(OSError):
    """A batch could not be mapped, and `stranded` of its addresses could not be unmapped again."""

    def __init__(self, errno: int, message: str, stranded: Sequence[int]) -> None:
        super().__init__(errno, message)
        self.stranded = list(stranded)


class Fence:
    """A point in the work queued on a GPU stream (see `VMMBackend.fence`). Work on one stream
    completes in order, so a later fence on the same `stream` covers everything an earlier one did."""

    __slots__ = ("stream",)

    def __init__(self, stream: int) -> None:
        self.stream = stream


class VMMBackend(ABC):
    """Reserve address space, create physical pages, map them at addresses, view as tensors.

    Pages are opaque integer handles (a pool offset on the host, a
    CUmemGenericAllocationHandle on CUDA). `map` is all-or-nothing: on failure it
    undoes what it mapped and raises, so callers never see a half-mapped batch (if even
    the undo fails, `MapError.stranded` says which addresses stay mapped).

    In a child made by fork() every backend the parent had is `forked`: its memory is
    the parent's, and the child must not touch it (see `after_fork_in_child`).
    """

    name: str
    page_size: int

    def __init__(self) -> None:
        self.forked = False
        _LIVE_BACKENDS.add(self)

    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserves `nbytes` of address space with nothing behind it; returns its address."""

    @abstractmethod
    def free_reservation(self, addr: int, nbytes: int, mapped: Sequence[int] = ()) -> None:
        """Gives a reservation back, with the pages still mapped in it at `mapped`, after all the
        work queued on the device (only a closing cache frees reservations: that is rare)."""

    @abstractmethod
    def create_pages(self, count: int) -> list[int]:
        """Creates `count` physical pages and returns their handles."""

    @abstractmethod
    def back_pages(self, pages: Sequence[int]) -> None:
        """Gives created pages their memory now, where creating them did not."""

    @abstractmethod
    def release_pages(self, pages: Sequence[int]) -> None:
        """Frees physical pages that are mapped nowhere."""

    @abstractmethod
    def map(self, addrs: Sequence[int], pages: Sequence[int]) -> None:
        """Maps pages[i] read-write at addrs[i] (each one page inside a reservation)."""

    @abstractmethod
    def unmap(self, addrs: Sequence[int], fences: Sequence[Fence] = ()) -> None:
        """Puts the bare reservation back at each page address, once the work before each of
        `fences` is done (the work that may read those pages; nothing else is waited for)."""

    def fence(self) -> Fence | None:
        """A fence after the work queued so far on the calling thread's current stream, or None
        when there is nothing to wait for (the host's: its work is done when its call returns)."""
        return None

    def populate(self, addrs: Sequence[int]) -> int:
        """Pre-faults mapped pages; returns how many were done (stops at the first error).

        A page unmapped meanwhile just stops the batch early: this never faults.
        """
        return len(addrs)

    @abstractmethod
    def tensor(
        self, addr: int, nbytes: int, owner: object = None, mapped: bool = False, dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        """A flat `dtype` tensor over `nbytes` of reserved address space (no copy).

        Pages mapped there show through; touching the rest faults. The tensor's storage
        (and so every view of it) keeps `owner` alive. `mapped` says the first page is
        mapped already.
        """

    def after_fork_in_child(self) -> None:
        """In a forked child: marks the backend `forked`; backends detach the parent's pages here."""
        self.forked = True

    @abstractmethod
    def close(self) -> None:
        """Frees whatever the backend still owns."""


_LIVE_BACKENDS: weakref.WeakSet[VMMBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for backend in list(_LIVE_BACKENDS):
        backend.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
