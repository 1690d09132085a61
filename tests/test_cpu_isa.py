"""The kernels a CPU's instructions choose, and the same choices under the environment's caps:
`ATEN_CPU_CAPABILITY` (torch's and vattn's SIMD bodies) and `ONEDNN_MAX_CPU_ISA` (oneDNN's
matmuls, and the flags vattn reads), how an AMX or AVX-512 machine checks the paths below it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from checks import printed_under

from serving.model.cpu_features import ONEDNN_ISAS, cpu_flags, cpu_kernels, flags_under, onednn_cap, usable_flags

KERNELS = {"avx512": ("scalar", "avx2", "avx512"), "avx2": ("scalar", "avx2"), "scalar": ("scalar",)}[cpu_kernels()]
SAPPHIRE_RAPIDS = frozenset(
    {
        *("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        *("avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"),
    }
)
"""An AMX Xeon's flags of interest (as the lent GPU machine's host lists them)."""


@pytest.mark.parametrize(
    ("cap", "hidden"),
    [
        ("AVX2", "avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8"),
        ("avx512_core", "avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8"),
        ("AVX512_CORE_BF16", "avx512_fp16 amx_tile amx_bf16 amx_int8"),
        ("AVX512_CORE_AMX", ""),
        ("DEFAULT", ""),
        ("", ""),
    ],
)
def test_onednn_cap_hides_the_flags_above_it(cap: str, hidden: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cap hides exactly the instructions oneDNN would not use under it (aliases and any case
    accepted; DEFAULT or nothing: no cap)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    usable_flags.cache_clear()  # read once a process: read under this cap, and again after it
    try:
        assert SAPPHIRE_RAPIDS - flags_under(SAPPHIRE_RAPIDS, onednn_cap()) == frozenset(hidden.split())
        assert cap.upper() not in ONEDNN_ISAS or onednn_cap() == ONEDNN_ISAS.index(cap.upper())
        assert usable_flags() <= cpu_flags()
    finally:
        usable_flags.cache_clear()


def test_aten_cpu_capability_avx2_forces_the_avx2_path() -> None:
    """As torch's own kernels: ATEN_CPU_CAPABILITY=avx2 makes the weight-only kernels take their
    AVX2 bodies: paired_linear's int16 one where outputs fill tiles of 16 (within int16 rounding
    of the scalar body), grouped_linear's float32 one elsewhere (equal to the scalar body); int8
    activations (`q8_0`) run as int16 there."""
    if "avx2" not in KERNELS:
        pytest.skip("this CPU has no AVX2")
    script = (
        "import torch\nfrom serving.model.cpu_features import cpu_kernels\n"
        "from serving.model.linear import GroupedLinear\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(3, 96)\n"
        "for outputs, rtol in ((64, 1e-3), (72, 1e-5)):\n"
        "    w = torch.randn(outputs, 96)\n"
        "    forced, scalar = GroupedLinear.quantized_int8(w, None), GroupedLinear.quantized_int8(w, None, 'scalar')\n"
        "    print(cpu_kernels(), forced.kernels, torch.allclose(forced(x), scalar(x), rtol=rtol, atol=rtol))\n"
        "print(GroupedLinear.quantized_int8(torch.randn(64, 96), None, activation_bits=8).kernels)"
    )
    printed = printed_under({"ATEN_CPU_CAPABILITY": "avx2"}, script)
    assert printed == ["avx2", "int16_avx2", "True", "avx2", "avx2", "True", "int16_avx2"]


@pytest.mark.parametrize("cap", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}])
def test_int8_activations_are_refused_where_int_mm_would_stall(cap: dict[str, str]) -> None:
    """Below AVX-512 VNNI (torch held at AVX2, or oneDNN below VNNI) _int_mm is ~20x slower than
    fp32 and saturates (16% error at AVX512_CORE): int8 is refused, naming what is fast there."""
    code = "try:\n    make_linear(torch.randn(64, 96), None, 'int8')\nexcept Exception as exc:\n    print(exc)"
    script = "import torch; from serving.model.linear import make_linear\n" + code
    printed = " ".join(printed_under(cap, script))
    assert "needs AVX-512 VNNI" in printed and "int8_weight_only" in printed


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16", "AVX512_CORE_AMX", None])
def test_projections_are_right_on_every_onednn_path(isa: str | None) -> None:
    """float32, bfloat16 and the bf16 preset, with oneDNN held below each ISA (ONEDNN_MAX_CPU_ISA;
    a cap above this CPU is its widest): the paths an AMX or AVX-512 BF16 machine takes, and
    those below it, compute the same product (bf16: its rounding, ~3e-3), on oneDNN's packed
    weights (bf16 on AMX's kernels where the CPU has AMX and the cap allows it)."""
    environment = os.environ | {"ONEDNN_MAX_CPU_ISA": isa} if isa else os.environ
    done = subprocess.run(
        [sys.executable, "-m", "measure.onednn"], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    errors = facts["relative_errors"]
    assert errors["float32"] < 1e-6 and errors["bfloat16"] < 1e-2 and errors["bf16_preset"] < 1e-2, facts
    implementations = facts["implementations"]
    assert facts["isa"] != "unknown" and not implementations["float32"].startswith("F.linear"), facts
    amx = "amx_bf16" in (cpu_flags() if isa else usable_flags()) and isa in (None, "AVX512_CORE_AMX")
    assert ("amx" in implementations["bfloat16"]) == amx, facts
    assert isa != "AVX2" or facts["isa"] == "Intel AVX2"
