"""The model's projections: fused, bf16 and int8 weights against fp32 arithmetic."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from serving.config import QUANTIZATIONS
from serving.model.cpu_features import (
    bf16_available,
    bf16_widened,
    cpu_kernels,
    int8_activations_fast,
    vnni_available,
)
from serving.model.linear import INT16_ROWS, DenseLinear, GroupedLinear, fused, make_linear, paired_kernels
from serving.model.runner import RescoredHead, largest_indices, lm_head
from serving.model.weights import INPUTS_PER_SCALE, GroupedWeight, PairedWeight
from tests.checks import four_bit_weight
from vattn.errors import UnavailableError
from vattn.ops import vattn_ops

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads

KERNELS = {"avx512": ("scalar", "avx2", "avx512"), "avx2": ("scalar", "avx2"), "scalar": ("scalar",)}[cpu_kernels()]
"""grouped_linear's SIMD paths this CPU can run (every one is compiled into every build)."""
PAIRED = {"int16_vnni": ("int16_vnni", "int16_avx2"), "int16_avx2": ("int16_avx2",), None: ()}[paired_kernels()]
"""paired_linear's bodies this CPU can run (both are compiled into every build)."""
NEEDS_PAIRED = pytest.mark.skipif(not PAIRED, reason="paired_linear needs AVX2")
NEEDS_VNNI = pytest.mark.skipif(not int8_activations_fast(), reason="the int8 preset needs AVX-512 VNNI")
NEEDS_INT8_VNNI = pytest.mark.skipif(not vnni_available(), reason="paired_linear's int8 activations need AVX-512 VNNI")


def _projection(out_features: int, in_features: int, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize(
    ("quantization", "tolerance"),
    [
        ("none", 1e-6),
        ("bf16", 2e-2),
        pytest.param("int8", 2e-2, marks=NEEDS_VNNI),
        ("int8_weight_only", 1e-2),
        ("q8_0", 2e-2),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_match_the_separate_ones(quantization: str, tolerance: float, bias: bool) -> None:
    parts = [_projection(n, 96, bias, seed) for seed, n in enumerate((64, 32, 32))]
    x = torch.randn(3, 5, 96)  # any leading shape
    expected = torch.cat([part(x) for part in parts], dim=-1).detach()
    got = fused(parts, quantization)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    error = (got - expected).norm() / expected.norm()
    assert error < tolerance, f"{quantization}: relative error {error:.2e}"


def test_float32_projections_run_on_onednn_packed_weights() -> None:
    """fp32 on the CPU: oneDNN's matmul on a weight packed once (not kept twice), the same
    product as F.linear for any row count and leading shape."""
    weight, bias = torch.randn(48, 96), torch.randn(48)
    linear = make_linear(weight, bias, "none")
    assert linear.weight.is_mkldnn
    for shape in [(0, 96), (1, 96), (16, 96), (100, 96), (2, 3, 96)]:
        x = torch.randn(shape)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no native bf16 here")
def test_bfloat16_projections_run_on_onednn_packed_weights() -> None:
    """A bf16 model's projections and the bf16 preset's: the weight packed once for oneDNN's bf16
    matmul (AVX-512 BF16, AMX), or where that matmul is slower than float32's (an Intel Xeon
    without AMX) kept as loaded and widened to float32 per call; F.linear's product in bf16 (to
    bf16's rounding: the sums may run in another order)."""
    weight, bias = torch.randn(48, 96), torch.randn(48)
    dense = make_linear(weight.to(torch.bfloat16), bias.to(torch.bfloat16), "none")
    preset = make_linear(weight, bias, "bf16")
    for linear in (dense, preset.linear):  # type: ignore[attr-defined]
        assert linear.widens and not linear.packed if bf16_widened() else linear.weight.is_mkldnn
    for shape in [(0, 96), (1, 96), (16, 96), (100, 96), (2, 3, 96)]:
        x = torch.randn(shape)
        expected = torch.nn.functional.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16), bias.to(torch.bfloat16))
        torch.testing.assert_close(dense(x.to(torch.bfloat16)), expected)
        torch.testing.assert_close(preset(x), expected.float(), rtol=1.6e-2, atol=1e-5)


@NEEDS_VNNI
def test_int8_scales_each_row_on_its_own() -> None:
    """An outlier token keeps its error to itself (one scale per row, not per call)."""
    linear = make_linear(torch.randn(48, 64), None, "int8")
    x = torch.randn(2, 64)
    x[0] *= 1000
    expected = x @ linear.weight_t.float().T.mul(linear.scales[:, None]).T  # type: ignore[attr-defined]
    got = linear(x)
    quiet_error = (got[1] - expected[1]).norm() / expected[1].norm()
    assert quiet_error < 2e-2


@NEEDS_VNNI
def test_int8_handles_zero_rows_and_empty_batches() -> None:
    linear = make_linear(torch.randn(16, 32), torch.ones(16), "int8")
    assert torch.equal(linear(torch.zeros(2, 32)), torch.ones(2, 16))
    assert linear(torch.zeros(0, 32)).shape == (0, 16)


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, bf16, int8, int8_weight_only"):
        make_linear(torch.randn(4, 4), None, "int4")
    assert QUANTIZATIONS == ("none", "bf16", "int8", "int8_weight_only", "q8_0", "gguf")


def test_four_bit_weights_hold_low_nibbles_first_then_high_ones() -> None:
    data = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # low nibble 1, high nibble 2
    weight = GroupedWeight(4, data, torch.ones(1, 1), torch.zeros(1, 1))
    assert weight.dequantize().tolist() == [[1.0] * 16 + [2.0] * 16]


def test_weight_only_int8_keeps_each_weight_within_half_its_groups_step() -> None:
    weight = torch.randn(24, 4 * INPUTS_PER_SCALE)
    weight[3, :INPUTS_PER_SCALE] *= 100  # an outlier group keeps its coarse step to itself
    quantized = GroupedLinear.quantized_int8(weight, None).weight
    step = quantized.scales.repeat_interleave(INPUTS_PER_SCALE, dim=1)
    assert ((quantized.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    assert quantized.scales[3, 0] > 50 * quantized.scales[3, 1]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 17, 64, 65, 130])
@pytest.mark.parametrize("bits", ["8", "4 with mins", "4 with -8 * scale"])
def test_grouped_weights_compute_the_dequantized_product_on_every_path(kernels: str, rows: int, bits: str) -> None:
    """Up to 64 rows take the register kernel (AVX-512, AVX2 or scalar), more the tiled GEMM: each
    equals x @ dequantized(W).T + b in float arithmetic."""
    torch.manual_seed(rows)
    bias = torch.randn(300)
    if bits == "8":
        linear = GroupedLinear.quantized_int8(torch.randn(300, 6 * INPUTS_PER_SCALE), bias, kernels, bf16_prompts=False)
    else:
        weight = four_bit_weight(300, 6 * INPUTS_PER_SCALE, with_mins=bits == "4 with mins")
        linear = GroupedLinear(weight, bias, kernels, bf16_prompts=False)
    x = torch.randn(rows, 6 * INPUTS_PER_SCALE)
    expected = x.double() @ linear.weight.dequantize().double().T + bias.double()
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", ["8", "4"])
def test_paired_weights_are_the_grouped_bytes_reordered(bits: str) -> None:
    """PairedWeight holds the same values (and a tied embedding reads its rows there)."""
    torch.manual_seed(1)
    outputs, inputs = 48, 3 * INPUTS_PER_SCALE
    grouped = (
        GroupedWeight.quantize_int8(torch.randn(outputs, inputs)) if bits == "8" else four_bit_weight(48, inputs, True)
    )
    paired = PairedWeight.of(grouped)
    assert paired.data.numel() == grouped.data.numel() and paired.scales.shape == (3, 3, 16)
    assert torch.equal(paired.dequantize(), grouped.dequantize())
    index = torch.tensor([47, 0, 17, 17, 30])
    looked_up = paired.rows(index)
    assert torch.equal(looked_up.data, grouped.rows(index).data)
    assert torch.equal(looked_up.dequantize(), grouped.dequantize()[index])


def test_int8_quads_are_the_grouped_weights_plus_128() -> None:
    """For int8 activations the 8-bit weight steps by quads of inputs, stored q + 128."""
    torch.manual_seed(1)
    grouped = GroupedWeight.quantize_int8(torch.randn(48, 3 * INPUTS_PER_SCALE))
    quads = PairedWeight.of(grouped, activation_bits=8)
    assert quads.step == 4 and quads.data.dtype == torch.uint8 and quads.data.numel() == grouped.data.numel()
    first = grouped.data[:16, :4].view(torch.int8).to(torch.int16) + 128  # tile 0, group 0, quad 0
    assert torch.equal(quads.data.reshape(3, 3, 8, 16, 4)[0, 0, 0].to(torch.int16), first)
    assert torch.equal(quads.dequantize(), grouped.dequantize())
    index = torch.tensor([47, 0, 17, 17, 30])
    assert torch.equal(quads.rows(index).data, grouped.rows(index).data)
    with pytest.raises(ValueError, match="8-bit weights only"):
        PairedWeight.of(four_bit_weight(48, 3 * INPUTS_PER_SCALE, True), activation_bits=8)
    if vnni_available():
        with pytest.raises(UnavailableError, match="8-bit weights and AVX-512 VNNI"):
            GroupedLinear(four_bit_weight(48, 3 * INPUTS_PER_SCALE, True), None, "int8_vnni")


@NEEDS_INT8_VNNI
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_int8_activations_compute_llamacpp_q8_0_arithmetic(rows: int) -> None:
    """`q8_0`: each row's groups of 32 activations rounded to int8 (the largest magnitude to 127,
    ties to even) and summed against the int8 weights exactly in int32: the output is the exact
    product of those quantized activations and weights, up to float32's scaling and sums."""
    torch.manual_seed(rows)
    outputs, inputs = 19 * 16, 6 * INPUTS_PER_SCALE
    bias = torch.randn(outputs)
    weight = torch.randn(outputs, inputs)
    linear = GroupedLinear.quantized_int8(weight, bias, activation_bits=8)
    assert linear.kernels == "int8_vnni" and linear.weight.activation_bits == 8
    x = torch.randn(rows, inputs) * torch.logspace(-3, 1, inputs)
    x[0, :INPUTS_PER_SCALE] = 0  # an all-zero group
    groups = x.reshape(rows, -1, INPUTS_PER_SCALE)
    largest = groups.abs().amax(dim=2, keepdim=True)
    q = torch.round(groups * torch.where(largest > 0, 127 / largest, 0))
    quantized = (q.double() * (largest / 127).double()).reshape(rows, inputs)
    w = linear.weight.dequantize().double()
    expected = quantized @ w.T + bias.double()
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    assert ((got.double() - expected).abs() <= 1e-6 * (quantized.abs() @ w.abs().T + 1)).all()
    int16 = GroupedLinear.quantized_int8(weight, bias)
    assert (got - int16(x)).abs().max() > 1e-3  # coarser than the int16 activations


@pytest.mark.parametrize("kernels", PAIRED)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 64, 130])
@pytest.mark.parametrize("bits", ["8", "4 with mins", "4 with -8 * scale"])
def test_paired_kernel_errs_by_at_most_int16_rounding_of_each_group(kernels: str, rows: int, bits: str) -> None:
    """paired_linear quantizes each row's groups of 32 activations to int16 (the largest
    magnitude to 32767): each output is within sum_k |w[n, k]| * step[r, k] / 2 of the exact
    product (plus float32 sums), on 19 tiles of 16 outputs (pairs of tiles and an odd one),
    for row counts that fill and leave blocks of either body (6 rows on VNNI, 3 on AVX2)."""
    torch.manual_seed(rows)
    outputs, inputs = 19 * 16, 6 * INPUTS_PER_SCALE
    bias = torch.randn(outputs)
    if bits == "8":
        linear = GroupedLinear.quantized_int8(torch.randn(outputs, inputs), bias, kernels)
    else:
        weight = four_bit_weight(outputs, inputs, with_mins=bits == "4 with mins")
        linear = GroupedLinear(weight, bias, kernels)
    assert isinstance(linear.weight, PairedWeight)
    x = torch.randn(rows, inputs) * torch.logspace(-3, 1, inputs)  # groups of very different ranges
    x[0, :INPUTS_PER_SCALE] = 0  # an all-zero group
    w = linear.weight.dequantize().double()
    expected = x.double() @ w.T + bias.double()
    step = (
        x.abs().reshape(rows, -1, INPUTS_PER_SCALE).amax(dim=2).double().repeat_interleave(INPUTS_PER_SCALE, dim=1)
        / 32767
    )
    bound = step / 2 @ w.abs().T + 1e-6 * (x.double().abs() @ w.abs().T + 1)
    got = paired(linear, x)
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    assert ((got.double() - expected).abs() <= bound).all()
    assert (got.double() - expected).abs().max() > 0  # it does quantize: not float32 arithmetic


@pytest.mark.skipif(len(PAIRED) < 2, reason="comparing the bodies needs AVX-512 VNNI")
@pytest.mark.parametrize("bits", ["8", "4 with mins"])
def test_paired_bodies_compute_the_same_bits(bits: str) -> None:
    """The AVX2 and VNNI bodies quantize alike and sum each group exactly in int32, then scale in
    the same order: a model's answers (and the quality measured on VNNI) are the same on both."""
    torch.manual_seed(2)
    outputs, inputs = 7 * 16, 12 * INPUTS_PER_SCALE
    weight = (
        GroupedWeight.quantize_int8(torch.randn(outputs, inputs)) if bits == "8" else four_bit_weight(112, inputs, True)
    )
    x, bias = torch.randn(37, inputs), torch.randn(outputs)
    vnni, avx2 = (GroupedLinear(weight, bias, kernels) for kernels in ("int16_vnni", "int16_avx2"))
    assert torch.equal(paired(vnni, x), paired(avx2, x))


def paired(linear: GroupedLinear, x: torch.Tensor) -> torch.Tensor:
    """vattn::paired_linear's product, whatever the row count (GroupedLinear on AVX2 sends calls
    of more than INT16_ROWS rows to vattn::widened_linear)."""
    w, vnni = linear.weight, linear.kernels == "int16_vnni"
    assert isinstance(w, PairedWeight)
    return vattn_ops().paired_linear(x, w.data, w.scales, w.mins, linear.bias, w.bits, vnni, 16)


@NEEDS_PAIRED
@pytest.mark.parametrize(("rows", "tiles"), [(1, 5), (5, 5), (6, 5), (7, 5), (9, 5), (64, 5), (600, 200), (800, 200)])
@pytest.mark.parametrize("bits", ["8", "4 with mins"])
def test_widened_kernel_is_the_float32_product_of_the_dequantized_weights(rows: int, tiles: int, bits: str) -> None:
    """widened_linear widens each tile of the weight to float32 once (as a GGUF's scales, float16,
    dequantize: exactly) and multiplies in float32: bit for bit tiled_linear's product on the
    dequantized weight, the same sums in the same order. 600 rows x 200 tiles: activations that
    stay in L2, each tile taken right after its widening; 800 rows: several chunks of rows over
    several batches of tiles in each thread."""
    torch.manual_seed(rows)
    outputs, inputs = tiles * 16, 6 * INPUTS_PER_SCALE
    if bits == "8":
        weight = GroupedWeight.quantize_int8(torch.randn(outputs, inputs))
    else:
        four = four_bit_weight(outputs, inputs, with_mins=True)
        weight = GroupedWeight(4, four.data, four.scales.half().float(), four.mins.half().float())  # type: ignore[union-attr]
    stored, bias, x = PairedWeight.of(weight), torch.randn(outputs), torch.randn(rows, inputs)
    got = vattn_ops().widened_linear(x, stored.data, stored.scales, stored.mins, bias, weight.bits)
    tiles = weight.dequantize().reshape(outputs // 16, 16, inputs, 1).permute(0, 2, 1, 3).contiguous()
    assert torch.equal(got, vattn_ops().tiled_linear(x, tiles, bias))


@NEEDS_PAIRED
def test_widened_kernel_refuses_what_it_cannot_run() -> None:
    ops, stored = vattn_ops(), PairedWeight.of(GroupedWeight.quantize_int8(torch.randn(16, 2 * INPUTS_PER_SCALE)))
    assert ops.widened_linear(torch.zeros(0, 64), stored.data, stored.scales, None, None, 8).shape == (0, 16)
    with pytest.raises(RuntimeError, match="x's last dimension must be the weight's 64 inputs, got 32"):
        ops.widened_linear(torch.randn(2, 32), stored.data, stored.scales, None, None, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous uint8/int8 with 512 bytes"):
        ops.widened_linear(torch.randn(2, 64), stored.data, stored.scales, stored.scales, None, 4)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ops.widened_linear(torch.randn(2, 64).double(), stored.data, stored.scales, None, None, 8)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.widened_linear(torch.randn(2, 64), stored.data, stored.scales, None, torch.zeros(15), 8)


@pytest.mark.skipif(paired_kernels() != "int16_avx2", reason="the widened body takes prompts on AVX2 only")
def test_avx2_runs_prompts_widened_and_decoding_rows_in_int16() -> None:
    torch.manual_seed(3)
    linear = GroupedLinear(four_bit_weight(48, 4 * INPUTS_PER_SCALE, with_mins=True), torch.randn(48))
    w, x = linear.weight, torch.randn(INT16_ROWS + 1, 4 * INPUTS_PER_SCALE)
    assert isinstance(w, PairedWeight)
    assert torch.equal(linear(x), vattn_ops().widened_linear(x, w.data, w.scales, w.mins, linear.bias, 4))
    assert torch.equal(linear(x[:INT16_ROWS]), paired(linear, x[:INT16_ROWS]))


@NEEDS_PAIRED
def test_paired_kernel_refuses_outputs_that_do_not_fill_tiles() -> None:
    assert GroupedLinear.quantized_int8(torch.randn(304, INPUTS_PER_SCALE), None).kernels == paired_kernels()
    with pytest.raises(UnavailableError, match="tiles of 16"):
        GroupedLinear.quantized_int8(torch.randn(300, INPUTS_PER_SCALE), None, paired_kernels())
    assert (
        GroupedLinear.quantized_int8(torch.randn(300, INPUTS_PER_SCALE), None).kernels == cpu_kernels()
    )  # the one that runs


@pytest.mark.skipif(not bf16_available(), reason="bfloat16 prompts need AVX512_BF16")
def test_prompts_may_multiply_in_bfloat16_and_decoding_rows_stay_float32() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(200, 4 * INPUTS_PER_SCALE), torch.randn(100, 4 * INPUTS_PER_SCALE)
    exact = GroupedLinear.quantized_int8(weight, None, bf16_prompts=False)
    fast = GroupedLinear.quantized_int8(weight, None, bf16_prompts=True)
    assert torch.equal(fast(x[:64]), exact(x[:64]))  # up to 64 rows: the float32 register kernel
    prompt, reference = fast(x), exact(x)
    assert not torch.equal(prompt, reference)
    assert (prompt - reference).norm() / reference.norm() < 1e-2


def test_weight_only_int8_handles_empty_batches_and_refuses_what_it_cannot_run() -> None:
    linear = GroupedLinear.quantized_int8(torch.randn(16, INPUTS_PER_SCALE), torch.ones(16))
    assert linear(torch.zeros(0, INPUTS_PER_SCALE)).shape == (0, 16)
    assert torch.equal(linear(torch.zeros(2, INPUTS_PER_SCALE)), torch.ones(2, 16))
    with pytest.raises(UnavailableError, match="groups of 32"):
        GroupedLinear.quantized_int8(torch.randn(4, 40), None)


def test_loading_the_operators_keeps_subnormal_floats() -> None:
    """A library built with -ffast-math sets flush-to-zero for the whole process when it loads."""
    vattn_ops()
    assert sys.float_info.min / 2 > 0
    assert torch.tensor(1e-40, dtype=torch.float32).item() > 0


@pytest.mark.parametrize("count", [64 * 9 + 1, 64 * 9, 64 * 768])
def test_largest_indices_finds_topks_values_through_block_maxima(count: int) -> None:
    """The k largest of each row, as topk finds them: rows whose top values crowd one block,
    spread over many, tie across blocks, or hold -inf and NaN (topk's largest); a row length no
    block width divides, or too few blocks, falls back to topk itself."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, count, generator=generator)
    values[1, 64:72] = 50.0 + torch.arange(8.0)  # all in one block
    values[2, ::64] = 40.0  # one per block, tied
    values[3, : count // 2] = float("-inf")
    values[4, 5] = float("nan")
    values[5] = torch.randn(count, generator=generator).round()  # many ties
    for k in (1, 8):
        found = largest_indices(values, k)
        expected = values.topk(k, dim=-1).values
        assert found.shape == (6, k) and found.dtype == torch.int64
        got = values.gather(1, found).sort(dim=-1, descending=True).values
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())
        assert all(len(set(row)) == k for row in found.tolist())  # k different indices


def test_the_bf16_class_rescores_its_lm_heads_top_logits_in_float32() -> None:
    """Under the bf16 preset, and for a bfloat16 model, the head multiplies in bf16 and its top
    logits again in float32 (greedy answers hang on near-ties between them, which bf16's output
    rounds away); other presets quantize it as the rest."""
    torch.manual_seed(0)
    head = torch.nn.Linear(96, 40, bias=True)
    x = torch.randn(3, 96)
    with torch.no_grad():  # a near-tie: output 9 beats output 7 by far less than bf16 resolves
        head.bias.zero_()
        head.weight[7] = head.weight[7].abs()
        head.weight[9] = head.weight[7]
        head.weight[:, 0] = 0.0
        head.weight[9, 0] = 1e-3
        head.weight[[7, 9]] *= 20 / (head.weight[7] @ x[0].abs()).abs()  # logits near 20: bf16 steps 0.125
        x[0] = x[0].abs()
    expected = torch.nn.functional.linear(x, head.weight, head.bias).detach()
    for linear, inputs in [(head, x), (copy.deepcopy(head).to(torch.bfloat16), x.to(torch.bfloat16))]:
        quantization = "bf16" if inputs.dtype == torch.float32 else "none"
        made = lm_head(linear, quantization)
        assert isinstance(made, RescoredHead)
        logits = made(inputs)
        assert logits.dtype == torch.float32
        reference = torch.nn.functional.linear(inputs.float(), linear.weight.float(), linear.bias.float()).detach()
        top = reference.topk(RescoredHead.CANDIDATES // 2, dim=-1).indices  # among the re-scored ones
        torch.testing.assert_close(logits.gather(-1, top), reference.gather(-1, top), rtol=1e-5, atol=1e-5)
        magnitude = torch.nn.functional.linear(inputs.float().abs(), linear.weight.float().abs())
        assert ((logits - reference).abs() <= 2**-7 * magnitude + 1e-6).all()  # the rest, as bf16 rounds
        assert logits[0].argmax() == reference[0].argmax() == 9
        bf16_only = torch.nn.functional.linear(inputs.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16())
        assert bf16_only[0, 9] == bf16_only[0, 7]  # what the re-scoring tells apart
    assert isinstance(lm_head(head, "none"), DenseLinear)
    assert torch.equal(lm_head(head, "bf16")(x).argmax(-1), expected.argmax(-1))
