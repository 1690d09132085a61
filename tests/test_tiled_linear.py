"""vattn::tiled_linear, the few-row projection: float32 sums of the products (bf16's exact), on
row counts within and across its blocks of 16, and DenseLinear's routing to it."""

from __future__ import annotations

import pytest
import torch

from serving.model.cpu_features import bf16_available, cpu_kernels
from serving.model.linear import TILED_ROWS, DenseLinear
from vattn.ops import vattn_ops

DTYPES = [torch.float32] * (cpu_kernels() == "avx512") + [torch.bfloat16] * bf16_available()
pytestmark = pytest.mark.skipif(not DTYPES, reason="tiled_linear needs AVX-512 (bf16: AVX512_BF16)")


def tiles(weight: torch.Tensor) -> torch.Tensor:
    out, inputs = weight.shape
    step = 2 if weight.dtype == torch.bfloat16 else 1
    return weight.reshape(out // 16, 16, inputs // step, step).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 13, 16, 17, 31, 48, 50])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_product_is_the_float32_sum_of_the_products(dtype: torch.dtype, rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 96, generator=generator).to(dtype)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    b = torch.randn(80, generator=generator) if bias else None
    got = vattn_ops().tiled_linear(x, tiles(weight), b)
    expected = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    assert got.dtype == dtype and got.shape == (rows, 80)
    tolerance = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=1e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_refuses_what_it_cannot_run(dtype: torch.dtype) -> None:
    ops, weight = vattn_ops(), tiles(torch.randn(32, 64).to(dtype))
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        ops.tiled_linear(torch.randn(2, 64).half(), weight, None)
    with pytest.raises(RuntimeError, match="weight must be contiguous CPU tiles"):
        ops.tiled_linear(torch.randn(2, 48).to(dtype), weight, None)
    with pytest.raises(RuntimeError, match="weight must be contiguous CPU tiles"):
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        ops.tiled_linear(torch.randn(2, 64).to(other), weight, None)
    with pytest.raises(RuntimeError, match="bias must be a float32 CPU tensor"):
        ops.tiled_linear(torch.randn(2, 64).to(dtype), weight, torch.zeros(31))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_projections_of_few_rows_run_on_tiles_and_agree_with_onednn(dtype: torch.dtype) -> None:
    """Up to TILED_ROWS rows take the tiled copy, more take oneDNN's packed weight; both give
    the product (bf16: to its rounding). Outputs that do not fill tiles of 16 keep oneDNN only."""
    weight, bias = torch.randn(48, 96).to(dtype), torch.randn(48).to(dtype)
    linear = DenseLinear(weight, bias)
    assert linear.tiles is not None and DenseLinear(torch.randn(40, 96).to(dtype), None).tiles is None
    for rows in [1, TILED_ROWS[dtype], TILED_ROWS[dtype] + 1]:
        x = torch.randn(rows, 96).to(dtype)
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.weight, bias, "none", [], "")
        torch.testing.assert_close(linear(x), onednn)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias))
