"""The model's matrix multiplies: dense weights as loaded, or int8 weights.

`int8` keeps each weight as symmetric int8 with one scale per output channel and
quantizes the activations per call (dynamic quantization), then multiplies in int8 with
fbgemm's kernels (`torch.ops.quantized.linear_dynamic`): AVX2 or AVX-512 VNNI int8 dot
products, a quarter of fp32's weight bytes. On the 2-core machines this project is
measured on it ran the default model's projections 2-5x faster than fp32 at 16-64 rows
(benchmarks/model_speed.py measures it, and its agreement with fp32). Of the int8
paths torch offers on a CPU this is the fastest without torch.compile; torch marks its
quantized tensor types deprecated, and torch is pinned.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

QUANTIZATIONS = ("none", "int8")


class Linear(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...


class DenseLinear:
    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    """Weights quantized once, per output channel; activations per call, per tensor."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # the deprecation notice of quantized tensors (see the module doc)
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.float())
        self.out_features = w.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        # reduce_range: 7-bit activations, so AVX2's saturating int8 multiply-add cannot overflow.
        out = torch.ops.quantized.linear_dynamic(x.float(), self._packed, True)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def make_linear(weight: Tensor, bias: Tensor | None, quantization: str) -> Linear:
    """A projection `x @ weight.T + bias` under `quantization` (one of QUANTIZATIONS)."""
    if quantization == "none":
        return DenseLinear(weight, bias)
    if quantization == "int8":
        return Int8Linear(weight, bias)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def fused(linears: list[torch.nn.Linear], quantization: str) -> Linear:
    """One projection computing several that read the same input (q, k, v; gate, up), outputs
    concatenated in order: one matrix multiply instead of several smaller ones."""
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat(
            [
                b if b is not None else linear.weight.new_zeros(linear.out_features)
                for b, linear in zip(biases, linears, strict=True)
            ]
        )
    return make_linear(weight, bias, quantization)
