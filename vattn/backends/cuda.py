"""GPU memory through the CUDA driver's virtual-memory calls, as the vAttention paper uses them.

reserve = cuMemAddressReserve; physical pages = cuMemCreate (pinned device memory,
any multiple of the allocation granularity); map = cuMemMap + cuMemSetAccess;
unmap = cuMemUnmap; release = cuMemRelease; free = cuMemAddressFree. Every CUresult
is checked. cuda-python is imported only when this backend is built, so importing
vattn never needs CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from vattn.backends.base import MapError, VMMBackend
from vattn.backends.cuda_calls import CudaCalls, select_cuda_calls
from vattn.errors import OutOfPagesError, UnavailableError


def import_driver() -> ModuleType:
    """cuda-python's driver module, or UnavailableError saying what is missing."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise UnavailableError(f"the CUDA backend needs cuda-python (pip install 'vattn[gpu]'): {exc}") from exc
    return driver


class CudaError(RuntimeError):
    """A CUDA driver call failed; carries the CUresult."""

    def __init__(self, driver: ModuleType, what: str, code: int) -> None:
        try:
            label = driver.CUresult(code).name
        except ValueError:
            label = "an unknown error"
        super().__init__(f"{what} failed: {label} (CUresult {code})")
        self.code = code


class _DeviceArray:
    """`nbytes` of device memory at `addr`, described for torch (__cuda_array_interface__); the
    tensor's storage holds the array, and the array its `owner`."""

    def __init__(self, addr: int, nbytes: int, owner: object) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2}
        self.owner = owner


class CudaBackend(VMMBackend):
    """Pages of device memory mapped into reservations of the GPU's virtual address space."""

    name = "cuda"

    def __init__(self, page_size: int, max_pages: int, native: bool | None) -> None:
        super().__init__()
        self._driver = driver = import_driver()
        if not torch.cuda.is_available():
            raise UnavailableError("the CUDA backend needs a GPU, and torch.cuda.is_available() is False here")
        index = torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        try:
            initialised = driver.cuInit(0)
        except Exception as exc:  # cuda-python raises its own error when libcuda cannot be found
            raise UnavailableError(f"the CUDA driver library cannot be loaded: {exc}") from exc
        self._check(initialised, "cuInit")
        handle = self._check(driver.cuDeviceGet(index), "cuDeviceGet")
        self._device_handle = handle
        self._context = self._check(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
        self._enter()
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        granularity = self._check(
            driver.cuMemGetAllocationGranularity(
                self._prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        self.granularity = int(granularity)
        if page_size % self.granularity:
            raise ValueError(f"page_size {page_size} must be a multiple of the CUDA granularity {self.granularity}")
        free, _ = self._check(driver.cuMemGetInfo(), "cuMemGetInfo")
        if max_pages * page_size > int(free):
            raise ValueError(
                f"the KV pool may grow to {max_pages * page_size} B but the GPU has {int(free)} B free: "
                "set memory_budget to what the cache may use"
            )
        self.page_size = page_size
        self.calls: CudaCalls = select_cuda_calls(native, driver, self._context, index)
        self._probe_page: int | None = None
        self._live_pages = 0
        self._closed = False

    def _check(self, result: tuple[Any, ...], what: str) -> Any:
        """Raises CudaError unless `result` (a cuda-python return tuple) starts with CUDA_SUCCESS."""
        err, *values = result
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise CudaError(self._driver, what, int(err))
        return values[0] if len(values) == 1 else tuple(values) or None

    def _enter(self) -> None:
        """Makes the context current in the calling thread (the background mapper's too)."""
        self._check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def reserve(self, nbytes: int) -> int:
        return int(self._check(self._driver.cuMemAddressReserve(nbytes, self.granularity, 0, 0), "cuMemAddressReserve"))

    def free_reservation(self, addr: int, nbytes: int, mapped: Sequence[int] = ()) -> None:
        self.unmap(mapped)
        self._check(self._driver.cuMemAddressFree(addr, nbytes), "cuMemAddressFree")

    def create_pages(self, count: int) -> list[int]:
        """Creates pages; if the GPU runs out, releases this call's pages and raises OutOfPagesError."""
        self._enter()
        pages: list[int] = []
        for _ in range(count):
            err, handle = self._driver.cuMemCreate(self.page_size, self._prop, 0)
            if err == self._driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                self.release_pages(pages)
                raise OutOfPagesError(count, len(pages))
            if err != self._driver.CUresult.CUDA_SUCCESS:
                self.release_pages(pages)
                raise CudaError(self._driver, "cuMemCreate", int(err))
            pages.append(int(handle))
            self._live_pages += 1
        return pages

    def release_pages(self, pages: Sequence[int]) -> None:
        self._enter()
        for page in pages:
            self._check(self._driver.cuMemRelease(page), "cuMemRelease")
            self._live_pages -= 1

    def map(self, addrs: Sequence[int], pages: Sequence[int]) -> None:
        done, err = self.calls.map_pages(addrs, pages, self.page_size)
        if done < len(addrs):
            undone, _ = self.calls.unmap_pages(addrs[:done], self.page_size)
            message = str(CudaError(self._driver, f"mapping page {done} of {len(addrs)}", err))
            raise MapError(0, message, addrs[undone:done])

    def unmap(self, addrs: Sequence[int]) -> None:
        done, err = self.calls.unmap_pages(addrs, self.page_size)
        if done < len(addrs):
            raise CudaError(self._driver, f"unmapping page {done} of {len(addrs)}", err)

    def tensor(
        self, addr: int, nbytes: int, owner: object = None, mapped: bool = False, dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        # torch asks the driver which device owns a pointer (cudaPointerGetAttributes), and
        # the driver answers only for mapped memory: unless `mapped`, a probe page sits at `addr` meanwhile.
        if mapped:
            return torch.as_tensor(_DeviceArray(addr, nbytes, owner), device=self.device).view(dtype)
        if self._probe_page is None:
            (self._probe_page,) = self.create_pages(1)
        self.map([addr], [self._probe_page])
        try:
            return torch.as_tensor(_DeviceArray(addr, nbytes, owner), device=self.device).view(dtype)
        finally:
            self.unmap([addr])

    @property
    def live_pages(self) -> int:
        """Physical pages created and not yet released (the probe page included)."""
        return self._live_pages

    def close(self) -> None:
        if self._closed or self.forked:  # a forked child cannot call the parent's CUDA context
            return
        self._closed = True
        if self._probe_page is not None:
            self.release_pages([self._probe_page])
            self._probe_page = None
        self._check(self._driver.cuDevicePrimaryCtxRelease(self._device_handle), "cuDevicePrimaryCtxRelease")
