"""Which oneDNN code runs vattn's projections here, and whether it computes them right.

    python -m measure.onednn     # one line of JSON

Runs a float32, a bfloat16 and a `bf16`-preset projection (serving.model.linear, as the engine
builds them) under ONEDNN_VERBOSE=1 in a process of its own, and reports oneDNN's ISA line
(what `ONEDNN_MAX_CPU_ISA` caps it to), the implementation float32 and bfloat16 projections ran
on (e.g. `brg_matmul:avx512_core_bf16`, AMX's `brg_matmul:avx10_1_512_amx`, or `F.linear` where
torch keeps bf16 off oneDNN), and each projection's error relative to float64. Every result file records it
(measure.results.machine_facts).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

SHAPE = (96, 64)
"""Outputs and inputs: small, so the probe costs a fraction of a second. Its rows are one more
than the most serving.model.linear.TILED_ROWS gives any dtype (fewer run on
vattn::tiled_linear, not oneDNN)."""


def _projections() -> dict[str, Any]:
    """Runs in the child: each projection once, with its error against float64, and whether bf16's
    widens to float32 (DenseLinear.widens: no oneDNN line for it)."""
    import torch

    from serving.model.linear import TILED_ROWS, Bf16Linear, DenseLinear

    (out, inputs), rows = SHAPE, max(TILED_ROWS.values()) + 1
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(out, inputs, generator=generator), torch.randn(rows, inputs, generator=generator)
    reference = x.double() @ weight.double().T
    cases = {
        "float32": (DenseLinear(weight, None), x),
        "bfloat16": (DenseLinear(weight.to(torch.bfloat16), None), x.to(torch.bfloat16)),
        "bf16_preset": (Bf16Linear(weight, None), x),
    }
    errors: dict[str, Any] = {}
    for name, (linear, inputs_) in cases.items():
        got = linear(inputs_).double()
        errors[name] = float((got - reference).norm() / reference.norm())
    return {"errors": errors, "bf16_widened": cases["bfloat16"][0].widens}


def report() -> dict[str, Any]:
    """oneDNN's ISA and each projection's implementation and error, from a child process that
    inherits this one's environment (its ISA caps included)."""
    environment = os.environ | {"ONEDNN_VERBOSE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", "import json, measure.onednn as m; print(json.dumps(m._projections()))"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["the probe failed"])[-1]}
    lines = done.stdout.splitlines()  # oneDNN's verbose lines, then the errors
    isa = next((line.split("isa:", 1)[1] for line in lines if ",info,cpu,isa:" in line), "unknown")
    implementations = dict.fromkeys(("float32", "bfloat16"), "F.linear (not oneDNN's packed matmul)")
    for line in lines:
        if ",inner_product," in line:
            dtype = "bfloat16" if "src:bf16" in line else "float32"
            implementations[dtype] = line.split(",inner_product,", 1)[1].split(",", 1)[0]
    child = json.loads(lines[-1])
    if child["bf16_widened"]:
        implementations["bfloat16"] = "the weight widened to float32, F.linear (DenseLinear.widens)"
    return {"isa": isa, "implementations": implementations, "relative_errors": child["errors"]}


@functools.cache
def facts() -> dict[str, Any]:
    """`report()`, once per process."""
    return report()


if __name__ == "__main__":
    print(json.dumps(report()))
