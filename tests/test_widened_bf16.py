"""vattn::widened_bf16 and the int8 presets' prompts on AMX: paired weights widened to bf16 once a
call and multiplied on oneDNN's matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.model.cpu_features import amx_bf16_available, cpu_flags
from serving.model.linear import AMX_PROMPT_ROWS, GroupedLinear, paired_kernels
from serving.model.weights import INPUTS_PER_SCALE, GroupedWeight, PairedWeight
from tests.checks import four_bit_weight, printed_under
from vattn.ops import vattn_ops

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads


@pytest.mark.parametrize("stored", ["8-bit pairs", "8-bit quads", "4-bit with mins", "4-bit, Q4_0"])
def test_widened_bf16_is_the_dequantized_weight_rounded_to_bf16(stored: str) -> None:
    """vattn::widened_bf16 (AMX's prompts) reads each paired layout (int8 pairs; q8_0's quads of
    q + 128; nibble pairs with mins) as GroupedWeight.dequantize does, then rounds to bf16."""
    outputs, inputs = 48, 6 * INPUTS_PER_SCALE
    if stored.startswith("8"):
        weight = GroupedWeight.quantize_int8(torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(3)))
    else:
        weight = four_bit_weight(outputs, inputs, with_mins=stored == "4-bit with mins")
    paired = PairedWeight.of(weight, 8 if stored == "8-bit quads" else 16)
    got = vattn_ops().widened_bf16(paired.data, paired.scales, paired.mins, paired.bits, paired.step)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, weight.dequantize().bfloat16())


def test_widened_bf16_refuses_what_it_cannot_read() -> None:
    ops, stored = vattn_ops(), PairedWeight.of(GroupedWeight.quantize_int8(torch.randn(16, 2 * INPUTS_PER_SCALE)))
    with pytest.raises(RuntimeError, match="step must be 2 \\(pairs\\), or 4 \\(quads\\) for 8-bit weights"):
        ops.widened_bf16(stored.data, stored.scales, None, 8, 3)
    with pytest.raises(RuntimeError, match="weight must be contiguous uint8/int8 with 512 bytes"):
        ops.widened_bf16(stored.data, stored.scales, stored.scales, 4, 2)


@pytest.mark.skipif(not amx_bf16_available(), reason="oneDNN multiplies bf16 on AMX only on CPUs that have it")
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_amx_prompts_multiply_the_widened_weight_on_onednn(activation_bits: int) -> None:
    """On AMX, calls of more than AMX_PROMPT_ROWS rows are oneDNN's bf16 product of the bf16
    activations and the dequantized weight rounded to bf16 (plus the float32 bias); fewer stay on
    paired_linear's integer arithmetic."""
    generator = torch.Generator().manual_seed(activation_bits)
    outputs, inputs = 64, 4 * INPUTS_PER_SCALE
    weight, bias = torch.randn(outputs, inputs, generator=generator), torch.randn(outputs, generator=generator)
    linear = GroupedLinear.quantized_int8(weight, bias, activation_bits=activation_bits)
    stored = GroupedWeight.quantize_int8(weight).dequantize().bfloat16()
    x = torch.randn(AMX_PROMPT_ROWS + 1, inputs, generator=generator)
    assert torch.equal(linear(x), F.linear(x.bfloat16(), stored).float() + bias)
    w = linear.weight
    assert isinstance(w, PairedWeight)
    vnni = linear.kernels in ("int8_vnni", "int16_vnni")
    few = x[:AMX_PROMPT_ROWS]
    expected = vattn_ops().paired_linear(few, w.data, w.scales, w.mins, bias, w.bits, vnni, w.activation_bits)
    assert torch.equal(linear(few), expected)


@pytest.mark.parametrize("cap", ["AVX512_CORE_BF16", None])
def test_amx_prompts_only_where_onednn_has_amx(cap: str | None) -> None:
    """Below AMX (the CPU has none, or ONEDNN_MAX_CPU_ISA caps oneDNN under it) paired weights'
    prompts stay on paired_linear."""
    script = (
        "import torch\nfrom serving.model.linear import GroupedLinear\n"
        "print(GroupedLinear.quantized_int8(torch.randn(16, 64), None).amx_prompts)"
    )
    words = printed_under({"ONEDNN_MAX_CPU_ISA": cap} if cap else {}, script)
    expected = cap is None and "amx_bf16" in cpu_flags() and bool(paired_kernels())
    assert words == [str(expected)]
