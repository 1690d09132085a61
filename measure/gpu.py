"""Shared by the GPU benchmarks: whether they can run here, and the facts of the GPU they ran on."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch


def cuda_unavailable_reason(need_bindings: bool = True) -> str | None:
    """Why the GPU benchmarks cannot run here (no CUDA GPU for torch, no cuda-python), or None."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    if need_bindings:
        try:
            from cuda.bindings import driver  # noqa: F401
        except ImportError as exc:
            return f"cuda-python is not installed (pip install 'vattn[gpu]'): {exc}"
    return None


def cannot_run(reason: str) -> NoReturn:
    """Prints `<script>: cannot run here: <reason>` to stderr and exits with status 2."""
    print(f"{Path(sys.argv[0]).stem}: cannot run here: {reason}", file=sys.stderr)
    raise SystemExit(2)


def exit_unless_cuda(need_bindings: bool = True) -> None:
    """Prints a one-line reason to stderr and exits with status 2 when there is no GPU to run on."""
    reason = cuda_unavailable_reason(need_bindings)
    if reason is not None:
        cannot_run(reason)


def package_version(*distributions: str) -> str | None:
    """The installed version of the first of `distributions` that is installed."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_facts() -> dict[str, Any]:
    """The GPU, its memory and the CUDA software stack (torch's build, the driver, cuda-python)."""
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    facts: dict[str, Any] = {
        "device_index": index,
        "device_name": torch.cuda.get_device_name(index),
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "total_memory_bytes": total,
        "free_memory_bytes_at_start": free,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_bindings": package_version("cuda-bindings", "cuda-python"),
        "cuda_python": package_version("cuda-python"),
        "driver_cuda_version": None,
    }
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if err == driver.CUresult.CUDA_SUCCESS:
            facts["driver_cuda_version"] = f"{version // 1000}.{version % 1000 // 10}"
    except ImportError:
        pass
    return facts
