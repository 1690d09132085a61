"""The model's projections: fused, bf16 and int8 weights against fp32 arithmetic."""

from __future__ import annotations

import sys

import pytest
import torch

from serving.linear import QUANTIZATIONS, fused, make_linear
from vattn.ops import vattn_ops


def _projection(out_features: int, in_features: int, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize(("quantization", "tolerance"), [("none", 1e-6), ("bf16", 2e-2), ("int8", 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_match_the_separate_ones(quantization: str, tolerance: float, bias: bool) -> None:
    parts = [_projection(n, 96, bias, seed) for seed, n in enumerate((64, 32, 32))]
    x = torch.randn(3, 5, 96)  # any leading shape
    expected = torch.cat([part(x) for part in parts], dim=-1).detach()
    got = fused(parts, quantization)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    error = (got - expected).norm() / expected.norm()
    assert error < tolerance, f"{quantization}: relative error {error:.2e}"


def test_int8_scales_each_row_on_its_own() -> None:
    """An outlier token keeps its error to itself (one scale per row, not per call)."""
    linear = make_linear(torch.randn(48, 64), None, "int8")
    x = torch.randn(2, 64)
    x[0] *= 1000
    expected = x @ linear.weight_t.float().T.mul(linear.scales[:, None]).T  # type: ignore[attr-defined]
    got = linear(x)
    quiet_error = (got[1] - expected[1]).norm() / expected[1].norm()
    assert quiet_error < 2e-2


def test_int8_handles_zero_rows_and_empty_batches() -> None:
    linear = make_linear(torch.randn(16, 32), torch.ones(16), "int8")
    assert torch.equal(linear(torch.zeros(2, 32)), torch.ones(2, 16))
    assert linear(torch.zeros(0, 32)).shape == (0, 16)


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, bf16, int8"):
        make_linear(torch.randn(4, 4), None, "int4")
    assert QUANTIZATIONS == ("none", "bf16", "int8")


def test_loading_the_operators_keeps_subnormal_floats() -> None:
    """A library built with -ffast-math sets flush-to-zero for the whole process when it loads."""
    vattn_ops()
    assert sys.float_info.min / 2 > 0
    assert torch.tensor(1e-40, dtype=torch.float32).item() > 0
