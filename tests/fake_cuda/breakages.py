"""Deliberately broken CUDA backends, to show the fake driver catches each mistake.

A pytest plugin: `VATTN_BREAK=<name> pytest -p tests.fake_cuda.breakages ...` runs the tests
with the backend broken as named; tests/test_fake_cuda_bites.py expects them to fail. The
Python call path is broken by replacing a method; the C path (native/vattn_native.c) by
building a copy of the C library from its source with one line changed, loaded in its place.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from vattn.backends import native
from vattn.backends.base import Fence, MapError
from vattn.backends.cuda import CudaBackend, CudaError
from vattn.backends.cuda_calls import DriverCudaCalls

original_map_pages = DriverCudaCalls.map_pages
original_release = CudaBackend.release_pages
original_calls_init = DriverCudaCalls.__init__
original_unmap = CudaBackend.unmap


def misaligned_map(self: DriverCudaCalls, addrs: Sequence[int], handles: Sequence[int], size: int) -> tuple[int, int]:
    return original_map_pages(self, [addr + 2048 for addr in addrs], handles, size)


def map_without_access(
    self: DriverCudaCalls, addrs: Sequence[int], handles: Sequence[int], size: int
) -> tuple[int, int]:
    driver = self._driver
    driver.cuCtxSetCurrent(self._context)
    for i, (addr, handle) in enumerate(zip(addrs, handles, strict=True)):
        (err,) = driver.cuMemMap(addr, size, 0, handle, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return i, int(err)
    return len(addrs), 0


def release_all_but_one(self: CudaBackend, pages: Sequence[int]) -> None:
    original_release(self, pages[1:])


class _NoContext:
    """The driver, but making a context current does nothing (calls run with whatever the thread has)."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any]:
        return (self._driver.CUresult.CUDA_SUCCESS,)


def calls_without_context(self: DriverCudaCalls, driver: Any, context: Any, device: int) -> None:
    """The context made current once, by the thread that builds the backend (a classic mistake)."""
    original_calls_init(self, _NoContext(driver), context, device)
    CudaBackend._enter = lambda backend: None  # type: ignore[method-assign]  # after the constructor's own


def map_without_rollback(self: CudaBackend, addrs: Sequence[int], pages: Sequence[int]) -> None:
    done, err = self.calls.map_pages(addrs, pages, self.page_size)
    if done < len(addrs):
        raise MapError(0, str(CudaError(self._driver, f"mapping page {done} of {len(addrs)}", err)), [])


def unmap_unfenced(self: CudaBackend, addrs: Sequence[int], fences: Sequence[Fence] = ()) -> None:
    """Unmaps without waiting for the GPU work that may still read the pages."""
    original_unmap(self, addrs)


BREAKAGES: dict[str, tuple[type, str, Callable[..., Any]]] = {
    "misaligned-map": (DriverCudaCalls, "map_pages", misaligned_map),
    "no-set-access": (DriverCudaCalls, "map_pages", map_without_access),
    "leaked-handle": (CudaBackend, "release_pages", release_all_but_one),
    "no-context": (DriverCudaCalls, "__init__", calls_without_context),
    "no-rollback": (CudaBackend, "map", map_without_rollback),
    "unfenced-unmap": (CudaBackend, "unmap", unmap_unfenced),
}


C_BREAKAGES: dict[str, tuple[str, str]] = {
    "c-misaligned-map": (
        "api->mem_map(addrs[i], page_size, 0, handles[i], 0)",
        "api->mem_map(addrs[i] + 2048, page_size, 0, handles[i], 0)",
    ),
    "c-no-set-access": ("(*err = api->mem_set_access(addrs[i], page_size, &access, 1)) != 0", "0"),
    "c-unfenced-unmap": ("(*err = api->event_synchronize((void *)(uintptr_t)events[i])) != 0", "0"),
}
"""C-path breakages: (a line's text in native/vattn_native.c, what it becomes)."""


def broken_c_library(old: str, new: str) -> Path:
    """The C library built from its source with `old` replaced by `new` (in a folder of its own)."""
    source = (Path(__file__).resolve().parents[2] / "native" / "vattn_native.c").read_text()
    assert source.count(old) == 1, f"the C source no longer has {old!r} once"
    folder = Path(tempfile.mkdtemp(prefix="vattn-broken-"))
    (folder / "broken.c").write_text(source.replace(old, new))
    library = folder / "libvattn_native.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, folder / "broken.c", "-ldl"], check=True)
    return library


def pytest_configure(config: pytest.Config) -> None:
    breakage = os.environ["VATTN_BREAK"]
    if breakage in C_BREAKAGES:
        native.NATIVE_LIBRARY = broken_c_library(*C_BREAKAGES[breakage])
        return
    owner, name, broken = BREAKAGES[breakage]
    setattr(owner, name, broken)
