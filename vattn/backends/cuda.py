"""GPU memory through the CUDA driver's virtual-memory calls, as the vAttention paper uses them.

reserve = cuMemAddressReserve; physical pages = cuMemCreate (pinned device memory,
any multiple of the allocation granularity); map = cuMemMap + cuMemSetAccess;
unmap = cuMemUnmap; release = cuMemRelease; free = cuMemAddressFree; fence = a CUevent
recorded on torch's current stream. Every CUresult is checked. cuda-python is imported
only when this backend is built, so importing vattn never needs CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

import torch

from vattn.backends.base import Fence, MapError, VMMBackend
from vattn.backends.cuda_calls import CudaCalls, select_cuda_calls
from vattn.errors import ConfigurationError, OutOfPagesError, UnavailableError


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


class TorchGpu:
    """torch's side of the GPU the backend maps for: which device, tensors over its addresses,
    and the memory torch's caching allocator holds."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise UnavailableError("the CUDA backend needs a GPU, and torch.cuda.is_available() is False here")
        self.index = torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)

    def tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        """A uint8 tensor over device memory (torch asks the driver who owns `addr`: it must be mapped)."""
        return torch.as_tensor(_DeviceArray(addr, nbytes, owner), device=self.device)

    def current_stream(self) -> int:
        """The CUstream handle of torch's current stream on this GPU in the calling thread."""
        return torch.cuda.current_stream(self.device).cuda_stream

    def cached_bytes(self) -> int:
        """Device memory torch's caching allocator holds but does not use (cuMemGetInfo counts it as taken)."""
        return torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index)

    def free_cached_memory(self) -> None:
        torch.cuda.empty_cache()


class CudaFence(Fence):
    """A CUevent recorded on `stream`, destroyed with the fence. `event` is None when it could
    not be recorded: then unmapping behind it waits for all the device's work."""

    __slots__ = ("_backend", "event")

    def __init__(self, backend: CudaBackend, stream: int, event: int | None) -> None:
        super().__init__(stream)
        self._backend = backend
        self.event = event

    def __del__(self) -> None:
        if self.event is not None:
            self._backend.destroy_event(self.event)


class CudaBackend(VMMBackend):
    """Pages of device memory mapped into reservations of the GPU's virtual address space.

    Nothing is unmapped while GPU work may still read it (a view or batch dies when Python lets
    go of it, not when the kernels that read it finish): an unmap first waits for the fences
    its caller gives, recorded after that work, and for no other work, so it never waits for
    the whole GPU queue. Pages are released and reservations freed only once unmapped.
    """

    name = "cuda"

    def __init__(
        self,
        page_size: int,
        max_pages: int,
        native: bool | None,
        driver: ModuleType | None = None,
        gpu: TorchGpu | None = None,
    ) -> None:
        """`driver` and `gpu` default to cuda-python's driver module and torch's current GPU."""
        super().__init__()
        self._closed = True  # until the context is retained
        self._driver = driver = driver or import_driver()
        self.gpu = gpu = gpu or TorchGpu()
        self.device = gpu.device
        try:
            initialised = driver.cuInit(0)
        except Exception as exc:  # cuda-python raises its own error when libcuda cannot be found
            raise UnavailableError(f"the CUDA driver library cannot be loaded: {exc}") from exc
        self._check(initialised, "cuInit")
        self._device_handle = self._check(driver.cuDeviceGet(gpu.index), "cuDeviceGet")
        self._context = self._check(driver.cuDevicePrimaryCtxRetain(self._device_handle), "cuDevicePrimaryCtxRetain")
        self._closed = False
        self._probe_page: int | None = None
        self._live_pages = 0
        try:
            self._enter()
            self._prop = driver.CUmemAllocationProp()
            self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            self._prop.location.id = gpu.index
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
            available = int(free) + gpu.cached_bytes()
            if max_pages * page_size > available:
                raise ConfigurationError(
                    f"the KV pool may grow to {max_pages * page_size} B but the GPU has {available} B free: "
                    "set memory_budget to what the cache may use"
                )
            self.page_size = page_size
            self.calls: CudaCalls = select_cuda_calls(native, driver, self._context, gpu.index)
        except BaseException:
            self.close()
            raise

    def _check(self, result: tuple[Any, ...], what: str) -> Any:
        """Raises CudaError unless `result` (a cuda-python return tuple) starts with CUDA_SUCCESS."""
        err, *values = result
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise CudaError(self._driver, what, int(err))
        return values[0] if len(values) == 1 else tuple(values) or None

    def _enter(self) -> None:
        """Makes the context current in the calling thread (the background mapper's, the garbage
        collector's): the driver's calls act on the calling thread's current context."""
        self._check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def reserve(self, nbytes: int) -> int:
        self._enter()
        return int(self._check(self._driver.cuMemAddressReserve(nbytes, self.granularity, 0, 0), "cuMemAddressReserve"))

    def free_reservation(self, addr: int, nbytes: int, mapped: Sequence[int] = ()) -> None:
        """Waits for all the device's work (cuCtxSynchronize) before unmapping: only a closing
        cache frees its reservations, and that is rare enough to wait for everything once."""
        if mapped:
            self._drain()
            self.unmap(mapped)
        self._enter()
        self._check(self._driver.cuMemAddressFree(addr, nbytes), "cuMemAddressFree")

    def create_pages(self, count: int) -> list[int]:
        """Creates pages; if the GPU runs out even after torch gives back its cached memory,
        releases this call's pages and raises OutOfPagesError."""
        self._enter()
        pages: list[int] = []
        for _ in range(count):
            err, handle = self._driver.cuMemCreate(self.page_size, self._prop, 0)
            if err == self._driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY and self.gpu.cached_bytes() >= self.page_size:
                self.gpu.free_cached_memory()
                self._enter()  # empty_cache may have made the runtime's context current
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

    def back_pages(self, pages: Sequence[int]) -> None:
        """Nothing: cuMemCreate allocated their memory."""

    def release_pages(self, pages: Sequence[int]) -> None:
        """Releases pages mapped nowhere (so no GPU work can still read them: each unmap waited for it)."""
        self._enter()
        for page in pages:
            self._check(self._driver.cuMemRelease(page), "cuMemRelease")
            self._live_pages -= 1

    def map(self, addrs: Sequence[int], pages: Sequence[int]) -> None:
        done, err = self.calls.map_pages(addrs, pages, self.page_size)
        if done < len(addrs):
            undone, _ = self.calls.unmap_pages(addrs[:done], self.page_size, ())  # nothing read them yet
            message = str(CudaError(self._driver, f"mapping page {done} of {len(addrs)}", err))
            raise MapError(0, message, addrs[undone:done])

    def unmap(self, addrs: Sequence[int], fences: Sequence[Fence] = ()) -> None:
        if not addrs:
            return
        waits = [cast(CudaFence, fence).event for fence in fences]
        if None in waits:
            self._drain()
        events = list(dict.fromkeys(event for event in waits if event is not None))  # a lease fences several slots
        done, err = self.calls.unmap_pages(addrs, self.page_size, events)
        if done < len(addrs):
            raise CudaError(self._driver, f"unmapping page {done} of {len(addrs)}", err)

    def fence(self) -> CudaFence | None:
        """A CUevent (no timing) recorded on torch's current stream in the calling thread; the
        work that used the fenced pages must be ordered before it on that stream."""
        if self._closed or self.forked:
            return None
        stream = self.gpu.current_stream()
        driver = self._driver
        try:
            self._enter()
            flags = int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            fence = CudaFence(self, stream, int(self._check(driver.cuEventCreate(flags), "cuEventCreate")))
            self._check(driver.cuEventRecord(fence.event, stream), "cuEventRecord")
        except CudaError:  # dropping the fence destroys its event; without one, unmapping waits for everything
            return CudaFence(self, stream, None)
        return fence

    def destroy_event(self, event: int) -> None:
        """A dropped fence's event goes, in whatever thread drops it; a failure leaks one event."""
        if self._closed or self.forked:
            return
        driver = self._driver
        (err,) = driver.cuCtxSetCurrent(self._context)
        if err == driver.CUresult.CUDA_SUCCESS:
            driver.cuEventDestroy(event)

    def _drain(self) -> None:
        """Waits for all the work queued on the device."""
        self._enter()
        self._check(self._driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def tensor(
        self, addr: int, nbytes: int, owner: object = None, mapped: bool = False, dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        # torch asks the driver which device owns a pointer (cudaPointerGetAttributes), and
        # the driver answers only for mapped memory: unless `mapped`, a probe page sits at `addr` meanwhile.
        if mapped:
            return self.gpu.tensor(addr, nbytes, owner).view(dtype)
        if self._probe_page is None:
            (self._probe_page,) = self.create_pages(1)
        self.map([addr], [self._probe_page])
        try:
            return self.gpu.tensor(addr, nbytes, owner).view(dtype)
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
        try:
            if self._probe_page is not None:
                self.release_pages([self._probe_page])
                self._probe_page = None
            if hasattr(self, "calls"):
                self.calls.close()
        finally:
            self._check(self._driver.cuDevicePrimaryCtxRelease(self._device_handle), "cuDevicePrimaryCtxRelease")
