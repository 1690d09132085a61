"""A CUDA GPU that holds no data, for CPU-only torch: FakeTensor mode, a device guard, the fake driver.

The tests' dry runs (tests/test_cuda_dry_run.py, tests/test_torch_flash_attn.py) use its parts;
`benchmarks/gpu_suite.sh` with FAKE_GPU=1 runs its GPU steps under all of it at once:

    python -m tests.fake_gpu -m MODULE [ARGS...]
    python -m tests.fake_gpu -c CODE

A tensor put on "cuda" is a torch FakeTensor (shape, dtype and device, no data) that runs every
operator's shape and device logic and raises where it meets a CPU tensor, as a GPU would; host
tensors stay real. The CUDA backend maps on tests/fake_cuda's driver at an H100's 2 MiB
granularity. What torch's CUDA build answers about itself is answered as on an sm90 GPU with
FlashAttention (`is_available`, `get_device_name` "fake GPU", `get_device_capability`,
`is_flash_attention_available`); `synchronize` has nothing to wait for. Nothing run this way
says anything about what a GPU computes or how fast: only that the code gets through.
"""

from __future__ import annotations

import ctypes
import runpy
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from tests.fake_cuda import FakeDriver, FakeTensorGpu, installed
from vattn.sizes import MiB

# c10's own fake CUDA device guard (FakeGuardImpl). Indexing a CUDA tensor (`t[i]`, `t[rows] = x`)
# takes a device guard in torch's Python bindings, even for a fake tensor, and a CPU-only build
# has none: "PyTorch is not linked with support for cuda devices". FakeTensorMode installs this
# guard itself (c10::impl::ensureCUDADeviceGuardSet) only for CUDA builds on machines without a GPU.
GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

// Installs (1) or removes (0) the guard; returns whether the registry changed.
extern "C" int fake_cuda_guard(int install) {
  static const c10::impl::DeviceGuardImplInterface* guard = new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>();
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  const c10::impl::DeviceGuardImplInterface* expected = install ? nullptr : guard;
  return slot.compare_exchange_strong(expected, install ? guard : nullptr);
}
"""
GUARD_LIBRARY = Path(__file__).resolve().parent.parent / "build" / "fake_cuda_guard" / "libfake_cuda_guard.so"
"""Built once per torch (its version in the folder's stamp), ~1 s."""


def cuda_device_guard() -> Any:
    """The guard's install/remove function, compiled against this torch if not built yet;
    RuntimeError when there is no C++ compiler."""
    stamp = GUARD_LIBRARY.with_suffix(".torch")
    if not (GUARD_LIBRARY.is_file() and stamp.is_file() and stamp.read_text() == torch.__version__):
        compiler = shutil.which("c++")
        if compiler is None:
            raise RuntimeError("the fake CUDA device guard needs a C++ compiler (c++)")
        GUARD_LIBRARY.parent.mkdir(parents=True, exist_ok=True)
        source = GUARD_LIBRARY.with_suffix(".cpp")
        source.write_text(GUARD_SOURCE)
        torch_dir = Path(torch.__file__).parent
        building = GUARD_LIBRARY.with_suffix(".so.part")
        subprocess.run(
            [
                compiler,
                "-std=c++17",
                "-O1",
                "-shared",
                "-fPIC",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                "-isystem",
                str(torch_dir / "include"),
                "-o",
                str(building),
                str(source),
                f"-L{torch_dir / 'lib'}",
                "-lc10",
                f"-Wl,-rpath,{torch_dir / 'lib'}",
            ],
            check=True,
            capture_output=True,
        )
        building.replace(GUARD_LIBRARY)  # whole or not at all, should two processes build it at once
        stamp.write_text(torch.__version__)
    return ctypes.CDLL(str(GUARD_LIBRARY)).fake_cuda_guard


@contextmanager
def device_guard() -> Iterator[None]:
    """A CUDA device guard for this CPU-only torch while inside (with a CUDA build, its own)."""
    if torch.backends.cuda.is_built():
        yield
        return
    guard = cuda_device_guard()
    changed = guard(1)  # else one is registered already
    try:
        yield
    finally:
        if changed:
            guard(0)


def _is_cuda(leaf: Any) -> bool:
    """A fake tensor, a CUDA one, or a CUDA device."""
    if isinstance(leaf, torch.Tensor):
        return isinstance(leaf, FakeTensor) or leaf.device.type == "cuda"
    return isinstance(leaf, torch.device) and leaf.type == "cuda"


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode for CUDA work only: an operator that reads a fake or CUDA tensor or names
    a CUDA device runs fake (real host tensors among its inputs are converted, so a CPU/CUDA mix
    raises a RuntimeError); every other one runs for real, so host tensors
    (the scheduler's tables, the sampler's logits) keep their values."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Sequence[type], args: Sequence[object] = (), kwargs: Any = None
    ) -> object:
        kwargs = kwargs or {}
        if any(_is_cuda(leaf) for leaf in pytree.tree_leaves((args, kwargs))):
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **kwargs)  # the mode is off while it dispatches: a real operator


@contextmanager
def fake_cuda_memory(memory: int = 80 << 30) -> Iterator[FakeDriver]:
    """The fake driver with an H100's granularity under the CUDA backend; nothing may leak."""
    driver = FakeDriver(granularity=2 * MiB, memory=memory)
    with installed(driver, FakeTensorGpu(driver)):
        yield driver
    assert not driver.violations, driver.violations
    assert not driver.leaks(), driver.leaks()


def _available_outside_torch() -> bool:
    """True to the program; False to torch itself, whose FakeTensorMode builds fake CUDA tensors
    the way it does on a machine without a GPU only when it sees none."""
    return not sys._getframe(1).f_globals.get("__name__", "").startswith("torch")


@contextmanager
def fake_gpu() -> Iterator[None]:
    """All of it: what a program that asks torch for a GPU finds, while inside."""
    driver = FakeDriver(granularity=2 * MiB, memory=80 << 30)
    with (
        device_guard(),
        installed(driver, FakeTensorGpu(driver)),
        pytest.MonkeyPatch.context() as patch,
        FakeCudaMode(),
    ):
        patch.setattr(torch.cuda, "is_available", _available_outside_torch)
        patch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        patch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        patch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        yield


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        raise SystemExit("usage: python -m tests.fake_gpu -m MODULE [ARGS...] | -c CODE")
    with fake_gpu():
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
