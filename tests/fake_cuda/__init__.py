"""A driver-faithful fake of the CUDA calls vattn makes, for CI machines with no GPU.

`installed(...)` puts a `FakeDriver` behind `vattn.backends.cuda` for a while: cuda-python
calls go to it, the C path's libcuda is `build/libfakecuda.so` (whose entry points call the
same fake), and the backend's torch side is a `HostGpu` (CPU tensors over the fake's host
memory) or a `FakeTensorGpu` (data-less `cuda` tensors under torch's FakeTensorMode). This
lives with the tests only: nothing in vattn can import it. It proves the control logic keeps
the documented contract, not that anything works on a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import vattn.backends.cuda
import vattn.backends.cuda_calls
from tests.fake_cuda.driver import DriverViolation, FakeDriver

SHIM = Path(__file__).resolve().parents[2] / "build" / "libfakecuda.so"

__all__ = ["DriverViolation", "FakeDriver", "FakeTensorGpu", "HostGpu", "installed"]


class HostGpu:
    """torch's side of the fake GPU: CPU tensors over the fake's host memory.

    Like torch (it asks the driver who owns a pointer), it refuses an address that is not
    mapped with access set. `cached` bytes play torch's caching allocator: taken from the
    fake device's memory until `free_cached_memory` gives them back. `stream` is torch's
    current stream (0, the legacy default one, unless a test switches to one of the fake's).
    """

    index = 0
    device = torch.device("cpu")

    def __init__(self, driver: FakeDriver, cached: int = 0) -> None:
        self.driver = driver
        self.cached = cached
        self.stream = 0
        driver.memory -= cached

    def check_pointer(self, addr: int) -> None:
        if not self.driver.accessible(addr):
            raise RuntimeError(f"cudaPointerGetAttributes: {addr:#x} is not mapped device memory")

    def tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        self.check_pointer(addr)
        array = (ctypes.c_uint8 * nbytes).from_address(addr)
        array.owner = owner  # type: ignore[attr-defined]  # the storage holds the array, the array its owner
        return torch.frombuffer(array, dtype=torch.uint8)

    def current_stream(self) -> int:
        return self.stream

    def cached_bytes(self) -> int:
        return self.cached

    def free_cached_memory(self) -> None:
        self.driver.memory += self.cached
        self.cached = 0


class FakeTensorGpu(HostGpu):
    """`cuda` tensors with no data (call under FakeTensorMode): for a dry run of the engine."""

    device = torch.device("cuda", 0)

    def tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        self.check_pointer(addr)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


_SET_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_EVENT_SYNCHRONIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_MAP = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_ulonglong
)
_SET_ACCESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
_UNMAP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_size_t)


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc as C lays it out: CUmemLocation {type, id}, then the flags."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]


def _guarded(driver: FakeDriver, call: object) -> object:
    """A C callback must not raise (ctypes would return 0, CUDA_SUCCESS): it records and fails."""

    def run(*args: object) -> int:
        try:
            return int(call(*args)[0])  # type: ignore[operator]
        except Exception as exc:
            driver.violations.append(f"the C path passed what cuda-bindings would refuse: {exc!r}")
            return 999  # CUDA_ERROR_UNKNOWN

    return run


def _shim_callbacks(driver: FakeDriver) -> tuple[object, ...]:
    def set_access(ptr: int, size: int, desc: int, count: int) -> tuple[object]:
        raw = (_AccessDesc * count).from_address(desc)
        descs = []
        for d in raw:
            access = driver.CUmemAccessDesc()
            access.location.type = driver.CUmemLocationType(d.type)
            access.location.id = d.id
            access.flags = driver.CUmemAccess_flags(d.flags)
            descs.append(access)
        return driver.cuMemSetAccess(ptr, size, descs, count)

    return (
        _SET_CURRENT(_guarded(driver, lambda ctx: driver.cuCtxSetCurrent(ctx or 0))),
        _EVENT_SYNCHRONIZE(_guarded(driver, lambda event: driver.cuEventSynchronize(event or 0))),
        _MAP(_guarded(driver, driver.cuMemMap)),
        _SET_ACCESS(_guarded(driver, set_access)),
        _UNMAP(_guarded(driver, driver.cuMemUnmap)),
    )


@contextmanager
def installed(driver: FakeDriver, gpu: HostGpu | None = None) -> Iterator[FakeDriver]:
    """While inside, every CudaBackend built with the defaults runs on `driver` (both call paths)."""
    if not SHIM.is_file():
        raise RuntimeError(f"{SHIM} is not built: run `make native`")
    shim = ctypes.CDLL(str(SHIM))
    callbacks = _shim_callbacks(driver)
    shim.fakecuda_install(*callbacks)
    gpu = gpu or HostGpu(driver)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vattn.backends.cuda, "import_driver", lambda: driver)
        patch.setattr(vattn.backends.cuda, "TorchGpu", lambda: gpu)
        patch.setattr(vattn.backends.cuda_calls, "LIBCUDA", str(SHIM))
        try:
            yield driver
        finally:
            shim.fakecuda_install(None, None, None, None, None)
    del callbacks
