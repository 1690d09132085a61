"""The virtual-memory primitives a KV cache needs, small enough for Linux and CUDA alike."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class VMMBackend(ABC):
    """Reserve address space, create physical pages, map them at addresses, view as tensors.

    Pages are opaque integer handles (a pool offset on the host, a
    CUmemGenericAllocationHandle on CUDA). `map` is all-or-nothing: on failure it
    undoes what it mapped and raises, so callers never see a half-mapped batch.
    """

    name: str
    page_size: int

    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserves `nbytes` of address space with nothing behind it; returns its address."""

    @abstractmethod
    def free_reservation(self, addr: int, nbytes: int) -> None:
        """Gives a reservation back; every page mapped in it must have been unmapped."""

    @abstractmethod
    def create_pages(self, count: int) -> list[int]:
        """Creates `count` physical pages and returns their handles."""

    @abstractmethod
    def release_pages(self, pages: Sequence[int]) -> None:
        """Frees physical pages that are mapped nowhere."""

    @abstractmethod
    def map(self, addrs: Sequence[int], pages: Sequence[int]) -> None:
        """Maps pages[i] read-write at addrs[i] (each one page inside a reservation)."""

    @abstractmethod
    def unmap(self, addrs: Sequence[int]) -> None:
        """Puts the bare reservation back at each page address."""

    def populate(self, addrs: Sequence[int]) -> int:
        """Pre-faults mapped pages; returns how many were done (stops at the first error).

        A page unmapped meanwhile just stops the batch early: this never faults.
        """
        return len(addrs)

    @abstractmethod
    def tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over `nbytes` of reserved, not yet mapped, address space (no copy).

        Pages mapped there later show through; touching the rest faults.
        """

    @abstractmethod
    def close(self) -> None:
        """Frees whatever the backend still owns."""
