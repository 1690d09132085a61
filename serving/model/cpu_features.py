"""What this CPU runs fast, read once: its flags, and the SIMD path torch and vattn's kernels take.

The linears (serving.model.linear) choose their kernels by it, `dtype` auto (serving.config) its
precision, and every results file (measure.results) records it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
)
"""`ONEDNN_MAX_CPU_ISA`'s values, narrowest first (oneDNN's own order; DEFAULT or ALL: no cap)."""
ONEDNN_ALIASES = {
    "AVX512_CORE_FP16": "AVX10_1_512",
    "AVX512_CORE_AMX": "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16",
}
FLAG_ISA = {"avx": "AVX", "avx2": "AVX2", "fma": "AVX2", "avx_vnni": "AVX2_VNNI", "avx512_vnni": "AVX512_CORE_VNNI"}
FLAG_ISA |= {"avx512_bf16": "AVX512_CORE_BF16", "avx512_fp16": "AVX10_1_512", "amx_fp16": "AVX10_1_512_AMX_FP16"}


def flag_isa(flag: str) -> str | None:
    """The narrowest oneDNN ISA that uses `flag` (None: a flag oneDNN's cap does not hide)."""
    if flag in FLAG_ISA:
        return FLAG_ISA[flag]
    return "AVX512_CORE" if flag.startswith("avx512") else "AVX10_1_512_AMX" if flag.startswith("amx") else None


def onednn_cap() -> int | None:
    """`ONEDNN_MAX_CPU_ISA` as a place in ONEDNN_ISAS, or None where it caps nothing."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    cap = ONEDNN_ALIASES.get(cap, cap)
    return ONEDNN_ISAS.index(cap) if cap in ONEDNN_ISAS else None


@functools.cache
def cpuinfo_field(name: str) -> str:
    """/proc/cpuinfo's first `name` line's value (empty where it has none); read once per
    process and field, not once per projection."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name)), "")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none)."""
    return frozenset(cpuinfo_field("flags").split())


def flags_under(flags: frozenset[str], cap: int | None) -> frozenset[str]:
    """`flags` less those above oneDNN ISA number `cap` (None: all of them)."""
    if cap is None:
        return flags
    return frozenset(f for f in flags if (isa := flag_isa(f)) is None or ONEDNN_ISAS.index(isa) <= cap)


@functools.cache
def usable_flags() -> frozenset[str]:
    """cpu_flags() less those above `ONEDNN_MAX_CPU_ISA`: a process capped below AMX or VNNI
    chooses its kernels as such a CPU would (how the lower paths are checked on a CPU that has
    more)."""
    return flags_under(cpu_flags(), onednn_cap())


def int8_activations_fast() -> bool:
    """Whether torch's `_int_mm` (the `int8` preset) is fast here: AVX-512 VNNI or AMX."""
    return cpu_kernels() == "avx512" and bool(usable_flags() & {"avx512_vnni", "amx_int8"})


def vnni_available() -> bool:
    """Whether AVX-512 VNNI bodies run here (the CPU has VNNI, torch at its AVX-512 capability)."""
    return cpu_kernels() == "avx512" and "avx512_vnni" in usable_flags()


def bf16_available() -> bool:
    """Whether bfloat16 GEMMs are fast here (AVX512_BF16 with torch at its AVX-512 capability)."""
    return cpu_kernels() == "avx512" and "avx512_bf16" in usable_flags()


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively for oneDNN's packed projections (AVX512_BF16
    or AMX, with torch at its AVX-512 capability and oneDNN taking bf16): where `dtype` auto
    picks the `bf16` preset."""
    fast = cpu_kernels() == "avx512" and bool(usable_flags() & {"avx512_bf16", "amx_bf16"})
    return fast and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_matmul_fast() -> bool:
    """Whether oneDNN's bf16 matmul outruns its float32 one on prompts here (bf16_native, and
    AMX, or a CPU not Intel's: AMD's Zen 4 about doubles float32's rate). An Intel Xeon whose
    AMX is absent or hidden (or capped by `ONEDNN_MAX_CPU_ISA`) runs bf16 on AVX512_BF16's dot
    products at 0.55-0.65x its float32 FMAs (results/avx512_intel/prompt_rows.*), and its bf16
    weights multiply faster widened to float32 (serving.model.linear.DenseLinear)."""
    return bf16_native() and ("amx_bf16" in usable_flags() or cpu_vendor() != "GenuineIntel")


def bf16_widened() -> bool:
    """Whether bf16 weights multiply widened to float32 here: the CPU multiplies bf16 natively,
    but oneDNN's bf16 matmul is not the fast one (bf16_native, not bf16_matmul_fast)."""
    return bf16_native() and not bf16_matmul_fast()


def cpu_vendor() -> str:
    """/proc/cpuinfo's `vendor_id` (`GenuineIntel`, `AuthenticAMD`; empty where it has none)."""
    return cpuinfo_field("vendor_id")


def amx_bf16_available() -> bool:
    """Whether oneDNN multiplies bfloat16 on AMX here (bf16_native, AMX's bf16 under
    `ONEDNN_MAX_CPU_ISA`): where its matmul costs about the same at 1 and 128 rows."""
    return bf16_native() and "amx_bf16" in usable_flags()


def cpu_kernels() -> str:
    """The widest SIMD path vattn's kernels take here: `avx512`, `avx2` or `scalar`, as torch's
    own CPU capability (which `ATEN_CPU_CAPABILITY` lowers) says."""
    capability = torch.backends.cpu.get_cpu_capability()
    return "avx512" if capability.startswith("AVX512") else "avx2" if capability == "AVX2" else "scalar"
