"""vattn::bf16_pairs_linear, the few-row bf16 projection: the product of float32 sums of the
exact bf16 products, on every row count it takes, and DenseLinear's routing to it."""

from __future__ import annotations

import pytest
import torch

from serving.model.cpu_features import bf16_available
from serving.model.linear import PAIRS_ROWS, DenseLinear
from vattn.ops import vattn_ops

pytestmark = pytest.mark.skipif(not bf16_available(), reason="bf16_pairs_linear needs AVX512_BF16")


def pairs(weight: torch.Tensor) -> torch.Tensor:
    out, inputs = weight.shape
    return weight.reshape(out // 16, 16, inputs // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 13, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_pairs_product_is_the_float32_sum_of_bf16_products(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 96, generator=generator).bfloat16()
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    b = torch.randn(80, generator=generator) if bias else None
    got = vattn_ops().bf16_pairs_linear(x, pairs(weight), b)
    expected = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=1e-3)


def test_pairs_refuses_what_it_cannot_run() -> None:
    ops, weight = vattn_ops(), pairs(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        ops.bf16_pairs_linear(torch.randn(17, 64).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        ops.bf16_pairs_linear(torch.randn(2, 64), weight, None)
    with pytest.raises(RuntimeError, match="weight must be contiguous bfloat16 pairs"):
        ops.bf16_pairs_linear(torch.randn(2, 48).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.bf16_pairs_linear(torch.randn(2, 64).bfloat16(), weight, torch.zeros(31))


def test_dense_bf16_projections_of_few_rows_run_on_pairs_and_agree_with_onednn() -> None:
    """Up to PAIRS_ROWS rows take the paired copy, more take oneDNN's packed weight; both give
    the product to bf16's rounding. Outputs that do not fill tiles of 16 keep oneDNN only."""
    weight, bias = torch.randn(48, 96).bfloat16(), torch.randn(48).bfloat16()
    linear = DenseLinear(weight, bias)
    assert linear.pairs is not None and DenseLinear(torch.randn(40, 96).bfloat16(), None).pairs is None
    for rows in [1, PAIRS_ROWS, PAIRS_ROWS + 1]:
        x = torch.randn(rows, 96).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.weight, bias, "none", [], "")
        torch.testing.assert_close(linear(x), onednn)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias))
