"""What this CPU runs fast, read once: its flags, and the SIMD path torch and vattn's kernels take.

The linears (serving.model.linear) choose their kernels by it, `dtype` auto (serving.config) its
precision, and every results file (measure.results) records it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none); read
    once per process, not once per projection."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return frozenset(flags)


def int8_activations_fast() -> bool:
    """Whether torch's `_int_mm` (the `int8` preset) is fast here: AVX-512 VNNI or AMX."""
    return cpu_kernels() == "avx512" and bool(cpu_flags() & {"avx512_vnni", "amx_int8"})


def vnni_available() -> bool:
    """Whether AVX-512 VNNI bodies run here (the CPU has VNNI, torch at its AVX-512 capability)."""
    return cpu_kernels() == "avx512" and "avx512_vnni" in cpu_flags()


def bf16_available() -> bool:
    """Whether bfloat16 GEMMs are fast here (AVX512_BF16 with torch at its AVX-512 capability)."""
    return cpu_kernels() == "avx512" and "avx512_bf16" in cpu_flags()


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively for oneDNN's packed projections (AVX512_BF16
    or AMX, with torch at its AVX-512 capability and oneDNN taking bf16): where `dtype` auto
    picks the `bf16` preset."""
    fast = cpu_kernels() == "avx512" and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return fast and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_kernels() -> str:
    """The widest SIMD path vattn's kernels take here: `avx512`, `avx2` or `scalar`, as torch's
    own CPU capability (which `ATEN_CPU_CAPABILITY` lowers) says."""
    capability = torch.backends.cpu.get_cpu_capability()
    return "avx512" if capability.startswith("AVX512") else "avx2" if capability == "AVX2" else "scalar"
