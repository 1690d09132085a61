"""The model's matrix multiplies: weights as loaded, in bf16, or in int8.

- `none`: weights as loaded; float32, and bfloat16 where oneDNN runs it natively (AVX-512
  BF16 or AMX), run on the CPU on oneDNN's matmul with each weight packed once for it in
  oneDNN's blocked layout (DenseLinear), about 2x torch's F.linear (MKL) on this AMD CPU. On an
  Intel CPU without AMX, where oneDNN's bf16 is slower than its float32, bf16 weights are
  multiplied widened to float32 instead (DenseLinear.widens).
- `bf16`: weights stored in bfloat16, packed for oneDNN the same way, and multiplied in bf16
  (fp32 accumulation), the activations converted per call; half of fp32's weight bytes, and
  on AMD CPUs with AVX-512 BF16 about twice fp32's speed (AMX: oneDNN's AMX kernels). The rest of
  the model (norms, attention, KV) stays in the model's dtype, and the LM head runs in float32
  (serving.model.runner.RescoredHead; a bfloat16 model's too, on the CPU).
- `int8`: weights as symmetric int8 with one scale per output channel, activations
  quantized per row as each call runs, multiplied in int8 (`vattn::int8_linear`, which
  uses torch's `_int_mm`). A quarter of fp32's weight bytes. Fast only where `_int_mm` is
  (AVX-512 VNNI); on AVX2-only CPUs it stalls.
- `int8_weight_only`: weights as symmetric int8 in groups of 32 inputs with one float32
  scale each (llama.cpp's Q8_0 layout): about 0.28x fp32's weight bytes and the float
  model's answers (decode reads weights, so it is the bytes that count). On AVX2 and
  AVX-512 (`vattn::paired_linear`) activations are quantized per group of 32 to int16 (an
  error under 1/65534 of the group's largest, well below bfloat16's rounding) and multiplied
  in int16 with int32 sums: on VNNI twice float32's multiply-adds per instruction, on AVX2
  float32's rate without widening each weight to float (calls of more rows, prompts, widen
  each tile of 16 outputs to float32 once and multiply in float32: `vattn::widened_linear`).
  Where outputs do not fill tiles of 16, or on CPUs without AVX2, `vattn::grouped_linear`
  multiplies in float32. On AMX, calls of more than AMX_PROMPT_ROWS rows (prompts) widen the
  weight to bf16 and multiply on oneDNN's AMX matmul, at bf16's rounding. The kernels
  are chosen from the CPU's flags as torch chooses its own (`ATEN_CPU_CAPABILITY=avx2`
  forces the AVX2 paths). Both also run a GGUF's Q8_0, Q4_0 and Q4_1 weights as stored.
- `q8_0`: llama.cpp's Q8_0 arithmetic: the same weights, and activations quantized per group
  of 32 to int8 (not int16), summed by vpdpbusd on AVX-512 VNNI (64 multiply-adds an
  instruction, ~1.7x int16's kernel: about 1 TFLOP/s on this machine's two cores). Its quality
  is Q8_0's (perplexity +0.23% against llama.cpp Q8_0's +0.25%), below `int8_weight_only`'s.
  Without VNNI it runs `int8_weight_only`'s int16 body. On AMX its prompts multiply in bf16, as
  `int8_weight_only`'s do (results/amx/quality.*: both within 0.01% of fp32's perplexity).
- `gguf`: a GGUF file's Q8_0, Q4_0 and Q4_1 projections as the file stores them (see
  serving.model.gguf_weights), on the same kernels; projections of other types run dequantized.

benchmarks/model_speed.py measures them against fp32: speed, and how often greedy
answers agree; benchmarks/quality.py their perplexity and next-token agreement. fbgemm's
dynamic linear (one activation scale per call) was faster still but lost too much: the
default model's perplexity on ordinary text went from 30.8 to 96 (53 without its reduced
range), against 32.5 with per-row scales and 30.85 in bf16.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from serving.config import QUANTIZATIONS
from serving.model.cpu_features import (
    amx_bf16_available,
    bf16_available,
    bf16_widened,
    cpu_kernels,
    int8_activations_fast,
    vnni_available,
)
from serving.model.weights import INPUTS_PER_SCALE, TILE, GroupedWeight, PairedWeight
from vattn.errors import UnavailableError
from vattn.ops import vattn_ops

PACKED_BATCH_HINT = 64
"""Rows oneDNN packs float32 weights for (any row count runs; this one picks the layout)."""


def paired_kernels(activation_bits: int = 16) -> str | None:
    """vattn::paired_linear's body for this CPU: `int16_vnni` on AVX-512 VNNI (`int8_vnni` when
    int8 activations are asked for), `int16_avx2` on other AVX2 or AVX-512 CPUs (1.4-3.7x
    grouped_linear's AVX2 body; against its AVX-512 one, measured here with VNNI unused,
    0.84-1.7x: behind at 16-64 rows of the down projection, ahead at 1 and 256 rows), None on
    older ones. AVX2 has no int8 multiply faster than its int16 one that cannot saturate
    (vpmaddubsw sums two 8-bit products in int16), so int8 activations run as int16 there."""
    if vnni_available():
        return "int8_vnni" if activation_bits == 8 else "int16_vnni"
    return None if cpu_kernels() == "scalar" else "int16_avx2"


class Linear(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...

    def rows_for(self, rows: int) -> int:
        """The rows a call of `rows` rows multiplies: more where it pads them (DenseLinear)."""
        ...


def onednn_packs(weight: Tensor) -> bool:
    """Whether oneDNN's matmul takes this weight packed: on the CPU, float32, or bfloat16 where
    oneDNN has native bf16 kernels (AVX-512 BF16, AMX; torch's own check)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


TILED_ROWS = {torch.bfloat16: 64, torch.float32: 128}
"""The most rows a projection runs on its tiled copy (vattn::tiled_linear): where it beats
oneDNN's matmul on the default model's 30 layers (benchmarks/results/few_rows.*, AMD EPYC with
AVX-512, 2 threads, medians): bf16 1.08-1.57x at 1-64 rows, 0.96x at 96; float32 1.17-1.61x at
1-64, 1.10-1.14x at 96-128; float32 on an AVX2-only EPYC (results/avx2/few_rows.*) 1.09-2.21x at
1-128; float32 on an Intel Xeon with AMX (results/amx/few_rows.*) 1.02-1.48x at 1-128."""

AMX_BF16_TILED_ROWS = 8
"""TILED_ROWS for bf16 where oneDNN multiplies bf16 on AMX: there its matmul takes
11-22 ms for the 30 layers at any of 1-128 rows, and the tiles (AVX512_BF16 dot products) win
up to about 8 rows (1.75x at 1, 1.23x at 4, level at 8; 0.51x at 16, 0.19x at 64:
results/amx/few_rows.*)."""


WIDENED_BF16_TILED_ROWS = 256
"""TILED_ROWS for bf16 where calls off the tiles widen the weight to float32 (bf16_widened): the
tiles, widened in registers, skip that pass and win to short prompts (results/avx512_intel/few_rows.*)."""


def tiled_rows(dtype: torch.dtype) -> int:
    """TILED_ROWS for `dtype` on this CPU, or AMX_BF16_TILED_ROWS or WIDENED_BF16_TILED_ROWS for bf16."""
    if dtype == torch.bfloat16 and amx_bf16_available():
        return AMX_BF16_TILED_ROWS
    if dtype == torch.bfloat16 and bf16_widened():
        return WIDENED_BF16_TILED_ROWS
    return TILED_ROWS[dtype]


def padded_rows(rows: int) -> int:
    """The row count a call of `rows` rows runs at on oneDNN's packed matmul: up to 15 zero rows
    more (63 past 256), so that a server meets a few dozen shapes, not one per step. oneDNN makes
    a primitive for every new input shape (torch's mkldnn linear keys them by shape); on an AMX
    Xeon a step's four projections took 12-28 ms more at a row count not seen before, and a
    serving step's rows (its prompt chunks plus its decodes) are seldom the last step's."""
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def tiles_run(weight: Tensor) -> bool:
    """Whether vattn::tiled_linear runs this weight: float32 on AVX2 or AVX-512, bf16 on
    AVX512_BF16, outputs that fill tiles of TILE (16, the paired weights' tile)."""
    if weight.dtype == torch.bfloat16:
        fast = bf16_available()
    else:
        fast = weight.dtype == torch.float32 and cpu_kernels() != "scalar"
    return fast and weight.shape[0] % TILE == 0 and weight.shape[1] % 2 == 0


class DenseLinear:
    """Weights as loaded. A projection oneDNN takes (`onednn_packs`) runs on its matmul with the
    weight packed once for it in oneDNN's blocked layout (`mkldnn._linear_pointwise`, as vLLM's
    CPU build and OpenVINO do; on AMX, oneDNN's AMX kernels): torch's F.linear goes through MKL,
    which takes slower paths on non-Intel CPUs, and re-lays a bf16 weight out on every call
    (2.3-3x slower for one row here, 1.1-1.3x for 256). Elsewhere F.linear.

    A packed weight that vattn::tiled_linear runs (`tiles_run`) is also kept in its tiles, for
    calls of up to tiled_rows() rows (decode steps of few requests): they are bound by reading the
    weight, which it streams faster than oneDNN's matmul and without its ~20 us a call. A second
    copy of the weight's bytes buys it.

    A bf16 weight in tiles where oneDNN's bf16 matmul is slower than its float32 one
    (`bf16_widened`) is kept as loaded instead of packed: calls of more rows widen it to
    float32 (one pass over 2 bytes a weight) and multiply the widened activations in float32,
    rounding the product to bf16 (the same sums as bf16's matmul, which accumulates in float32);
    and its tiles multiply widened in registers (tiled_linear's `widen`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.bias = bias
        self.packed = onednn_packs(weight)
        self.tiles: Tensor | None = None
        self.widens = self.packed and weight.dtype == torch.bfloat16 and tiles_run(weight) and bf16_widened()
        if self.widens:
            self.packed, self.float_bias = False, None if bias is None else bias.float()
        if (self.packed or self.widens) and tiles_run(weight):
            out, inputs = weight.shape
            step = 2 if weight.dtype == torch.bfloat16 else 1
            self.tiles = weight.reshape(out // TILE, TILE, inputs // step, step).permute(0, 2, 1, 3).contiguous()
            self.tiles_bias = None if bias is None else bias.float().contiguous()
            self.tiled_rows = tiled_rows(weight.dtype)
            self._tiled_linear = vattn_ops().tiled_linear
        # Packed, the weight is oneDNN's own copy (the loaded one is not kept beside it).
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_BATCH_HINT) if self.packed else weight.contiguous()
        )

    def rows_for(self, rows: int) -> int:
        """padded_rows(rows) where the call runs on oneDNN's packed matmul, else `rows`."""
        tiled = self.tiles is not None and rows <= self.tiled_rows
        return padded_rows(rows) if self.packed and not tiled else rows

    def __call__(self, x: Tensor) -> Tensor:
        if self.tiles is not None and x.dim() == 2 and x.shape[0] <= self.tiled_rows and x.dtype == self.tiles.dtype:
            return self._tiled_linear(x.contiguous(), self.tiles, self.tiles_bias, self.widens)
        return self.untiled(x)

    def untiled(self, x: Tensor) -> Tensor:
        """The product off the tiles: oneDNN's packed matmul, the widened weight's, or F.linear's."""
        if self.packed:
            rows = x.shape[0]
            if x.dim() == 2 and (padded := padded_rows(rows)) != rows:
                x = with_rows(x, padded)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]
        if self.widens:
            return F.linear(x.float(), self.weight.float(), self.float_bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def with_rows(x: Tensor, rows: int) -> Tensor:
    """x `[n, ...]` copied with zero rows after it up to `rows` (only those zeroed: F.pad fills all of them first)."""
    out = x.new_empty((rows, *x.shape[1:]))
    out[: x.shape[0]].copy_(x)
    out[x.shape[0] :].zero_()
    return out


class Bf16Linear:
    """A float model's projection in bfloat16: the weight stored (and packed, DenseLinear) in
    bf16, the activations converted to bf16 and back around each call."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        bias_bf16 = None if bias is None else bias.detach().to(torch.bfloat16)
        self.linear = DenseLinear(weight.detach().to(torch.bfloat16), bias_bf16)

    def rows_for(self, rows: int) -> int:
        return self.linear.rows_for(rows)

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(x.to(torch.bfloat16)).to(x.dtype)


class Int8Linear:
    """Weights quantized once, per output channel; activations per row, per call."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        if weight.device.type != "cpu":
            raise UnavailableError(
                f"int8 quantization runs on the CPU (vattn::int8_linear); these weights are on {weight.device}: "
                "use quantization 'none' or 'bf16'"
            )
        if not int8_activations_fast():
            raise UnavailableError(
                "int8 quantization needs AVX-512 VNNI (torch's _int_mm has no fast kernel on this CPU, "
                f"capability {torch.backends.cpu.get_cpu_capability()}): use quantization 'int8_weight_only', "
                "which is fast on AVX2 and keeps the model's answers"
            )
        w = weight.detach().float()
        self.scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.weight_t = (w / self.scales[:, None]).round().to(torch.int8).t().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        self._linear = vattn_ops().int8_linear

    def rows_for(self, rows: int) -> int:
        return rows

    def __call__(self, x: Tensor) -> Tensor:
        out = self._linear(x.float(), self.weight_t, self.scales, self.bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


PAIRED_KERNELS = ("int8_vnni", "int16_vnni", "int16_avx2")
"""vattn::paired_linear's bodies (grouped_linear's: `avx512`, `avx2`, `scalar`)."""

INT16_ROWS = 20
"""On AVX2 (`int16_avx2`), the most rows a call multiplies in int16 (vattn::paired_linear);
more go to vattn::widened_linear, which widens each tile of the weight to float32 once and
multiplies in float32: the dequantized weights' float32 product. The widening is paid once a
call, so it wins from about 24 rows on; below, the int16 kernel is faster (against the float32
model's projections, medians of 3 rounds on an AVX2-only EPYC: int16 1.29x and widened 1.11x at
16 rows, 1.19x and 1.14x at 20, 1.12x and 1.19x at 24).
benchmarks/results/avx2/stored_rows.* gives both kernels against the float32 model at 1-2048 rows."""


AMX_PROMPT_ROWS = 128
"""Where oneDNN multiplies bf16 on AMX, paired weights' calls of more rows than this (prompts)
widen the weight to bf16 once a call (vattn::widened_bf16) and multiply on oneDNN's matmul, at
bf16's rounding of the activations and weights (as grouped_linear's bf16 prompts): AMX's rate
pays for the widening from a few hundred rows, and the int8 presets' prompts were most of their
offline time on the VNNI dot products (results/amx/offline_compare_int8.* is the run after)."""


class GroupedLinear:
    """`x @ W.T + b` on a GroupedWeight; activations arrive and leave in float32. Where
    paired_kernels() names a body (AVX-512 VNNI, AVX2) and the outputs fill tiles of TILE, the
    weight is held paired (PairedWeight) and calls run vattn::paired_linear (on AVX2, those of
    more than INT16_ROWS rows vattn::widened_linear; on AMX, those of more than AMX_PROMPT_ROWS
    oneDNN's bf16 matmul on the widened weight); elsewhere vattn::grouped_linear (`avx512`,
    `avx2` or `scalar`) on the weight as given."""

    def __init__(
        self,
        weight: GroupedWeight,
        bias: Tensor | None,
        kernels: str | None = None,
        bf16_prompts: bool | None = None,
        activation_bits: int = 16,
    ) -> None:
        out = weight.scales.shape[0]
        paired = paired_kernels(activation_bits if weight.bits == 8 else 16)
        self.kernels = kernels or (paired if paired and out % TILE == 0 else cpu_kernels())
        vnni = self.kernels in ("int8_vnni", "int16_vnni")
        runs = vnni_available() if vnni else paired is not None
        eight_bit = self.kernels != "int8_vnni" or weight.bits == 8
        if self.kernels in PAIRED_KERNELS and (out % TILE or not runs or not eight_bit):
            raise UnavailableError(
                f"the {self.kernels} kernels need outputs in tiles of {TILE}"
                f"{', 8-bit weights' if self.kernels == 'int8_vnni' else ''} and {'AVX-512 VNNI' if vnni else 'AVX2'} "
                f"(here {out} outputs of {weight.bits}-bit weights, CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}): use kernels 'avx512', 'avx2' or 'scalar'"
            )
        self.weight: GroupedWeight | PairedWeight = (
            PairedWeight.of(weight, 8 if self.kernels == "int8_vnni" else 16)
            if self.kernels in PAIRED_KERNELS
            else weight
        )
        self.bias = None if bias is None else bias.detach().float()
        self.bf16_prompts = bf16_available() if bf16_prompts is None else bf16_prompts
        """Whether grouped_linear's calls of many rows (prompts) multiply in bfloat16: on
        AVX512_BF16, ~3x float32 at bf16's rounding (decoding rows stay float32)."""
        ops = vattn_ops()
        self._paired, self._grouped, self._widened = ops.paired_linear, ops.grouped_linear, ops.widened_linear
        self._widened_bf16 = ops.widened_bf16
        self.amx_prompts = isinstance(self.weight, PairedWeight) and amx_bf16_available()

    @classmethod
    def quantized_int8(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        kernels: str | None = None,
        bf16_prompts: bool | None = None,
        activation_bits: int = 16,
    ) -> GroupedLinear:
        out, inputs = weight.shape
        if weight.device.type != "cpu" or inputs % INPUTS_PER_SCALE:
            raise UnavailableError(
                f"{'int8_weight_only' if activation_bits == 16 else 'q8_0'} runs on the CPU with inputs in groups of "
                f"{INPUTS_PER_SCALE}; these weights are [{out}, {inputs}] on {weight.device}: "
                "use quantization 'none' or 'bf16'"
            )
        return cls(GroupedWeight.quantize_int8(weight), bias, kernels, bf16_prompts, activation_bits)

    def rows_for(self, rows: int) -> int:
        return rows

    def __call__(self, x: Tensor) -> Tensor:
        w, simd = self.weight, self.kernels
        if isinstance(w, PairedWeight) and self.amx_prompts and x.numel() > AMX_PROMPT_ROWS * x.shape[-1]:
            out = F.linear(x.to(torch.bfloat16), self._widened_bf16(w.data, w.scales, w.mins, w.bits, w.step))
            return (out if self.bias is None else out.float() + self.bias).to(x.dtype)
        if isinstance(w, PairedWeight) and simd == "int16_avx2" and x.numel() > INT16_ROWS * x.shape[-1]:
            out = self._widened(x.float(), w.data, w.scales, w.mins, self.bias, w.bits)
        elif isinstance(w, PairedWeight):
            vnni = simd in ("int8_vnni", "int16_vnni")
            out = self._paired(x.float(), w.data, w.scales, w.mins, self.bias, w.bits, vnni, w.activation_bits)
        else:
            avx512, avx2 = simd == "avx512", simd == "avx2"
            out = self._grouped(x.float(), w.data, w.scales, w.mins, self.bias, w.bits, avx512, avx2, self.bf16_prompts)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def make_linear(weight: Tensor, bias: Tensor | None, quantization: str) -> Linear:
    """A projection `x @ weight.T + bias` under `quantization` (one of QUANTIZATIONS)."""
    if quantization == "none":
        return DenseLinear(weight, bias)
    if quantization == "bf16":
        return Bf16Linear(weight, bias)
    if quantization == "int8":
        return Int8Linear(weight, bias)
    if quantization == "int8_weight_only":
        return GroupedLinear.quantized_int8(weight, bias)
    if quantization == "q8_0":
        return GroupedLinear.quantized_int8(weight, bias, activation_bits=8)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def fused(linears: list[torch.nn.Linear], quantization: str) -> Linear:
    """One projection computing several that read the same input (q, k, v; gate, up), outputs
    concatenated in order: one matrix multiply instead of several smaller ones. A single
    projection keeps its own weight (no copy: a tied LM head stays the embedding's). Under
    `gguf`, projections that carry the file's `grouped_weight` (serving.model.gguf_weights) use it."""
    stored = [getattr(linear, "grouped_weight", None) for linear in linears]
    weights = [linear.weight.detach() for linear in linears]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
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
    if quantization == "gguf":
        if all(stored) and len({w.bits for w in stored}) == 1:  # type: ignore[union-attr]
            one = stored[0] if len(stored) == 1 else GroupedWeight.concat(stored)  # type: ignore[arg-type]
            return GroupedLinear(one, bias)  # type: ignore[arg-type]
        quantization = "none"  # a tensor the file holds in another type: its dequantized weights
    return make_linear(weight, bias, quantization)
