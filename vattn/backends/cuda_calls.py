"""Batched cuMemMap/cuMemSetAccess/cuMemUnmap for the CUDA backend: the C library, or cuda-python.

Both make the backend's context current in the calling thread first (so the background
mapper needs no setup of its own) and report how many pages they finished plus the
CUresult that stopped them, so the backend can roll a failed batch back exactly. An unmap
first waits for the CUevents it is given (recorded after the work that may still read the
pages: the driver does not promise that cuMemUnmap waits for it), and for nothing else.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from vattn.backends.native import load_native, u64_array
from vattn.errors import UnavailableError


class CudaCalls(Protocol):
    name: str

    def map_pages(self, addrs: Sequence[int], handles: Sequence[int], page_size: int) -> tuple[int, int]: ...

    def unmap_pages(self, addrs: Sequence[int], page_size: int, events: Sequence[int]) -> tuple[int, int]: ...

    def close(self) -> None: ...


LIBCUDA = "libcuda.so.1"
"""The driver library the C path opens."""


class DriverCudaCalls:
    """cuda-python, one map and one set-access call per page."""

    name = "cuda-python"

    def __init__(self, driver: ModuleType, context: Any, device: int) -> None:
        self._driver = driver
        self._context = context
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]

    def map_pages(self, addrs: Sequence[int], handles: Sequence[int], page_size: int) -> tuple[int, int]:
        driver = self._driver
        (err,) = driver.cuCtxSetCurrent(self._context)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0, int(err)
        for i, (addr, handle) in enumerate(zip(addrs, handles, strict=True)):
            (err,) = driver.cuMemMap(addr, page_size, 0, handle, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                return i, int(err)
            (err,) = driver.cuMemSetAccess(addr, page_size, self._access, 1)
            if err != driver.CUresult.CUDA_SUCCESS:
                driver.cuMemUnmap(addr, page_size)
                return i, int(err)
        return len(addrs), 0

    def unmap_pages(self, addrs: Sequence[int], page_size: int, events: Sequence[int]) -> tuple[int, int]:
        driver = self._driver
        (err,) = driver.cuCtxSetCurrent(self._context)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0, int(err)
        for event in events:
            (err,) = driver.cuEventSynchronize(event)
            if err != driver.CUresult.CUDA_SUCCESS:
                return 0, int(err)
        for i, addr in enumerate(addrs):
            (err,) = driver.cuMemUnmap(addr, page_size)
            if err != driver.CUresult.CUDA_SUCCESS:
                return i, int(err)
        return len(addrs), 0

    def close(self) -> None:
        pass


class NativeCudaCalls:
    """One call into libvattn_native per batch, which calls libcuda with the GIL released."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, context_handle: int, device: int) -> None:
        lib.vattn_cuda_open.restype = ctypes.c_void_p
        lib.vattn_cuda_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.vattn_cuda_close.restype = None
        lib.vattn_cuda_close.argtypes = [ctypes.c_void_p]
        u64p, errp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int)
        lib.vattn_cuda_map_pages.restype = ctypes.c_long
        lib.vattn_cuda_map_pages.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_long,
            u64p,
            u64p,
            ctypes.c_uint64,
            errp,
        ]
        lib.vattn_cuda_unmap_pages.restype = ctypes.c_long
        lib.vattn_cuda_unmap_pages.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_long,
            u64p,
            ctypes.c_long,
            u64p,
            ctypes.c_uint64,
            errp,
        ]
        why = ctypes.create_string_buffer(512)
        self._api = lib.vattn_cuda_open(LIBCUDA.encode(), why, len(why))
        if not self._api:
            raise UnavailableError(f"native CUDA mapping cannot load {LIBCUDA}: {why.value.decode()}")
        self._lib = lib
        self._context = context_handle
        self._device = device

    def map_pages(self, addrs: Sequence[int], handles: Sequence[int], page_size: int) -> tuple[int, int]:
        err = ctypes.c_int(0)
        done = self._lib.vattn_cuda_map_pages(
            self._api,
            self._context,
            self._device,
            len(addrs),
            u64_array(addrs),
            u64_array(handles),
            page_size,
            ctypes.byref(err),
        )
        return done, err.value

    def unmap_pages(self, addrs: Sequence[int], page_size: int, events: Sequence[int]) -> tuple[int, int]:
        err = ctypes.c_int(0)
        done = self._lib.vattn_cuda_unmap_pages(
            self._api,
            self._context,
            len(events),
            u64_array(events),
            len(addrs),
            u64_array(addrs),
            page_size,
            ctypes.byref(err),
        )
        return done, err.value

    def close(self) -> None:
        if self._api:
            self._lib.vattn_cuda_close(self._api)
            self._api = None


def select_cuda_calls(native: bool | None, driver: ModuleType, context: Any, device: int) -> CudaCalls:
    """The C library when asked for or built (None); cuda-python when asked for or missing."""
    lib = load_native(native)
    return DriverCudaCalls(driver, context, device) if lib is None else NativeCudaCalls(lib, int(context), device)
