"""The model runner's CPU operators for RMSNorm (with the residual add fused in), the rotary
embedding and the gated MLP's activation, against transformers' and torch's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from serving.model.runner import GatedActivation, Norm, rotate

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_norm_matches_llama_rms_norm(dtype: torch.dtype, tolerance: float) -> None:
    module = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    torch.nn.init.normal_(module.weight)
    x = torch.randn(7, 96).to(dtype)
    torch.testing.assert_close(Norm.of(module)(x), module(x), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_add_and_norm_updates_the_residual_and_norms_the_sum(dtype: torch.dtype, tolerance: float) -> None:
    module = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    torch.nn.init.normal_(module.weight)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    expected_sum = residual + x
    normed = Norm.of(module).add_and_norm(x, residual)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(normed, module(expected_sum), rtol=tolerance, atol=tolerance)


def test_add_and_norm_sums_a_float32_residual_under_a_bfloat16_input() -> None:
    """A bf16 model's residual stream in float32: the sum kept exactly in float32, its norm as
    LlamaRMSNorm norms a float32 input with the bf16 weight, written in bf16."""
    module = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(module.weight)
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64)
    expected_sum = residual + x.float()
    normed = Norm.of(module).add_and_norm(x, residual)
    assert torch.equal(residual, expected_sum)
    assert normed.dtype == torch.bfloat16
    torch.testing.assert_close(normed, module(expected_sum).bfloat16(), rtol=0, atol=0)


def test_norm_refuses_a_weight_of_the_wrong_width() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        Norm(torch.ones(32), 1e-6)(torch.randn(2, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_matches_apply_rotary_pos_emb_on_split_views(dtype: torch.dtype) -> None:
    """q and k are views into one fused QKV output, as the model runner passes them."""
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = torch.randn(tokens, dim // 2).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    expected_q, expected_k = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin, unsqueeze_dim=1)
    untouched_v = v.clone()
    got_q, got_k = rotate(q, k, cos, sin)
    tolerance = 0  # the same operations, the same rounding, bf16 too
    torch.testing.assert_close(got_q, expected_q, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_k, expected_k, rtol=tolerance, atol=tolerance)
    assert torch.equal(v, untouched_v)


SILU_CHECK = """
import torch
from serving.model.runner import GatedActivation
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows, width in ((1, 8), (7, 1536), (3, 13)):  # widths that end mid-vector too
        x = (torch.randn(rows, 2 * width + 6) * 6).to(dtype)[:, : 2 * width]  # rows strided
        x[0, :6] = torch.tensor([-100.0, 100.0, float("nan"), float("inf"), -float("inf"), 0.0])[: min(6, width)]
        gate, up = x.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        got = GatedActivation("silu")(x)
        exact = dtype != torch.float32  # rounded to 16 bits: torch's to the bit (float16: torch's ops)
        torch.testing.assert_close(got, expected, rtol=0 if exact else 1e-6, atol=0, equal_nan=True)
print("ok")
"""


ROTARY_AND_NORM_CHECK = """
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from serving.model.runner import Norm, rotate
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for tokens, heads, kv_heads, dim in ((6, 4, 2, 16), (37, 9, 3, 64), (5, 2, 1, 128)):  # half a vector to four
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
        angles = torch.randn(tokens, dim // 2).repeat(1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
        expected = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin, unsqueeze_dim=1)
        for got, want in zip(rotate(q, k, cos, sin), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for rows, width in ((3, 64), (70, 576), (2, 100)):  # widths that end mid-vector too
        module = LlamaRMSNorm(width, eps=1e-5).to(dtype)
        torch.nn.init.normal_(module.weight)
        x, residual = torch.randn(rows, width).to(dtype), torch.randn(rows, width)
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(Norm.of(module)(x), module(x), rtol=tolerance, atol=tolerance)
        expected_sum = residual + x.float()
        normed = Norm.of(module).add_and_norm(x, residual)
        assert torch.equal(residual, expected_sum)
        torch.testing.assert_close(normed, module(expected_sum).to(dtype), rtol=tolerance, atol=tolerance)
print("ok")
"""
BODY_CHECKS = {"silu_and_mul": SILU_CHECK, "rotary_and_norm": ROTARY_AND_NORM_CHECK}


@pytest.mark.parametrize("capability", ["", "avx2"])
@pytest.mark.parametrize("operators", list(BODY_CHECKS))
def test_each_simd_body_matches_the_reference(operators: str, capability: str) -> None:
    """Each SIMD body of the operators (chosen as torch chooses its own, by ATEN_CPU_CAPABILITY),
    in a process of its own. SiLU(gate) * up: a 16-bit result equal to torch's silu then mul to
    the bit, float32 within 1e-6 (another exp), and infinities and NaN as torch gives them. The
    rotary embedding: transformers' to the bit, bf16 too. RMSNorm (and the residual add before it):
    LlamaRMSNorm's within the dtype's tolerance, the float32 residual's sum exact."""
    if not capability and torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this process's own body is the avx2 case's: it runs it")
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env |= {"ATEN_CPU_CAPABILITY": capability} if capability else {}
    result = subprocess.run([sys.executable, "-c", BODY_CHECKS[operators]], env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.split() == ["ok"], result.stderr


def test_a_non_silu_activation_runs_as_torch_operators() -> None:
    x = torch.randn(4, 16)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(GatedActivation("gelu")(x), torch.nn.functional.gelu(gate) * up)
