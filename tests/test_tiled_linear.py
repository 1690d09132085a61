"""vattn::tiled_linear, the few-row projection: float32 sums of the products (bf16's exact), on
row counts within and across its blocks (16 rows on AVX-512, 6 on AVX2), its AVX2 body held to
wherever the CPU has more, and DenseLinear's routing to it."""

from __future__ import annotations

import pytest
import torch
from checks import printed_under

from serving.model import linear as linear_module
from serving.model.cpu_features import bf16_available, cpu_flags, cpu_kernels
from serving.model.linear import DenseLinear, padded_rows, tiled_rows
from vattn.ops import vattn_ops

DTYPES = [torch.float32] * (cpu_kernels() != "scalar") + [torch.bfloat16] * bf16_available()
pytestmark = [
    pytest.mark.skipif(not DTYPES, reason="tiled_linear needs AVX2 (bf16: AVX512_BF16)"),
    pytest.mark.usefixtures("several_threads"),  # each thread takes a share of the tiles
]


def tiles(weight: torch.Tensor) -> torch.Tensor:
    out, inputs = weight.shape
    step = 2 if weight.dtype == torch.bfloat16 else 1
    return weight.reshape(out // 16, 16, inputs // step, step).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize(
    ("dtype", "widen"), [(dtype, False) for dtype in DTYPES] + [(torch.bfloat16, True)] * bf16_available()
)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 16, 17, 25, 31, 48, 50, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_product_is_the_float32_sum_of_the_products(
    dtype: torch.dtype, widen: bool, rows: int, bias: bool
) -> None:
    """Also bf16 widened to float32 in registers (`widen`: past 8 rows FMAs, not vdpbf16ps), pairs
    of tiles in even blocks of rows."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 96, generator=generator).to(dtype)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    b = torch.randn(80, generator=generator) if bias else None
    got = vattn_ops().tiled_linear(x, tiles(weight), b, widen)
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
    """Up to tiled_rows() rows take the tiled copy, more take oneDNN's packed weight (padded to
    padded_rows, the padding's rows dropped); both give the product (bf16: to its rounding).
    Outputs that do not fill tiles of 16 keep oneDNN only."""
    weight, bias = torch.randn(48, 96).to(dtype), torch.randn(48).to(dtype)
    linear = DenseLinear(weight, bias)
    assert linear.tiles is not None and DenseLinear(torch.randn(40, 96).to(dtype), None).tiles is None
    for rows in [1, tiled_rows(dtype), tiled_rows(dtype) + 1, 300]:  # 300: padded to 320 rows for oneDNN
        x = torch.randn(rows, 96).to(dtype)
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.weight, bias, "none", [], "")
        torch.testing.assert_close(linear(x), onednn)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias))


@pytest.mark.skipif(not bf16_available(), reason="bf16 tiles need AVX512_BF16")
def test_bf16_prompts_widened_to_float32_give_the_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN's bf16 matmul is slower than its float32 (bf16_widened true; forced here
    on any CPU), a bf16 weight stays as loaded beside its tiles, and calls of more than
    TILED_ROWS rows multiply it widened to float32: bf16's product, at the rows asked."""
    monkeypatch.setattr(linear_module, "bf16_widened", lambda: True)
    weight, bias = torch.randn(48, 96).bfloat16(), torch.randn(48).bfloat16()
    linear = DenseLinear(weight, bias)
    assert linear.widens and not linear.packed and linear.tiles is not None
    for rows in [1, tiled_rows(torch.bfloat16), tiled_rows(torch.bfloat16) + 1, 300]:
        x = torch.randn(rows, 96).bfloat16()
        expected = (x.double() @ weight.double().T + bias.double()).bfloat16()
        assert linear.rows_for(rows) == rows
        torch.testing.assert_close(linear(x), expected, rtol=1.6e-2, atol=1e-2)


def test_avx2_body_is_the_float32_sum_and_refuses_bf16() -> None:
    """Under ATEN_CPU_CAPABILITY=avx2 (as torch's own kernels) float32 takes the AVX2 body, on
    any CPU with AVX2, and gives the product; bf16, whose pairs need AVX512_BF16, is refused
    there, and DenseLinear keeps a bf16 weight on oneDNN alone."""
    script = (
        "import torch\nfrom serving.model.linear import DenseLinear\nfrom vattn.ops import vattn_ops\n"
        "torch.manual_seed(0)\n"
        "for rows in (1, 5, 6, 7, 12, 64):\n"
        "    weight, bias, x = torch.randn(80, 96), torch.randn(80), torch.randn(rows, 96)\n"
        "    tiles = weight.reshape(5, 16, 96, 1).permute(0, 2, 1, 3).contiguous()\n"
        "    got = vattn_ops().tiled_linear(x, tiles, bias).double()\n"
        "    print(torch.allclose(got, x.double() @ weight.double().T + bias.double(), rtol=1e-5, atol=1e-5))\n"
        "print(DenseLinear(torch.randn(32, 64).bfloat16(), None).tiles is None)\n"
        "try:\n"
        "    vattn_ops().tiled_linear(torch.randn(2, 64).bfloat16(), torch.randn(2, 32, 16, 2).bfloat16(), None)\n"
        "except RuntimeError as exc:\n"
        "    print('needs AVX2 (bfloat16: AVX512_BF16)' in str(exc))"
    )
    assert printed_under({"ATEN_CPU_CAPABILITY": "avx2"}, script) == ["True"] * 8


@pytest.mark.parametrize("cap", ["AVX512_CORE_BF16", None])
def test_bf16_decode_rows_leave_the_tiles_for_amx_where_onednn_has_it(cap: str | None) -> None:
    """On AMX oneDNN's bf16 matmul beats the tiles from 16 rows on (results/amx/few_rows.*), so
    bf16 calls of more than AMX_BF16_TILED_ROWS go to it; below AMX (the CPU has none, or
    ONEDNN_MAX_CPU_ISA caps oneDNN under it) they keep the tiles up to TILED_ROWS, or up to
    WIDENED_BF16_TILED_ROWS where bf16 calls off the tiles widen the weight to float32."""
    script = (
        "import torch\nfrom serving.model.cpu_features import bf16_widened, usable_flags\n"
        "from serving.model.linear import AMX_BF16_TILED_ROWS, TILED_ROWS, WIDENED_BF16_TILED_ROWS, tiled_rows\n"
        "amx = 'amx_bf16' in usable_flags()\n"
        "below = WIDENED_BF16_TILED_ROWS if bf16_widened() else TILED_ROWS[torch.bfloat16]\n"
        "print(amx, tiled_rows(torch.bfloat16) == (AMX_BF16_TILED_ROWS if amx else below))\n"
        "print(tiled_rows(torch.float32) == TILED_ROWS[torch.float32])"
    )
    words = printed_under({"ONEDNN_MAX_CPU_ISA": cap} if cap else {}, script)
    assert words == [str(cap is None and "amx_bf16" in cpu_flags()), "True", "True"]


def test_onednn_calls_meet_few_row_counts() -> None:
    """Calls of 1-2048 rows reach oneDNN at 44 row counts (multiples of 16 to 256, of 64 past),
    never fewer rows than asked and at most 15 (63) more."""
    counts = {padded_rows(rows) for rows in range(1, 2049)}
    assert len(counts) == 16 + 28
    assert all(0 <= padded_rows(r) - r <= (15 if r <= 256 else 63) for r in range(1, 2049))
