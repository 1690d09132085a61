"""Weight formats of the quantized projections: a weight quantized in groups of INPUTS_PER_SCALE inputs
(GroupedWeight: llama.cpp's Q8_0, Q4_0 and Q4_1 layouts) and the same bytes reordered into tiles
of TILE outputs for vattn::paired_linear's SIMD bodies (PairedWeight)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INPUTS_PER_SCALE = 32
"""Inputs per scale of `int8_weight_only` (as in a GGUF's Q8_0 blocks)."""
TILE = 16
"""Outputs per vector of vattn::paired_linear."""


@dataclass(frozen=True)
class GroupedWeight:
    """A weight `[out, in]` quantized in groups of INPUTS_PER_SCALE inputs along each output row:
    bits 8 (int8 q, w = scale * q: llama.cpp's Q8_0) or bits 4 (two inputs a byte, w = scale *
    q + min: Q4_1, and Q4_0 with min = -8 * scale; byte j of a group holds input j in its low
    nibble and input j + 16 in its high one)."""

    bits: int
    data: Tensor
    """uint8 `[out, groups * (32 if bits == 8 else 16)]`."""
    scales: Tensor
    """float32 `[out, groups]`."""
    mins: Tensor | None = None
    """float32 `[out, groups]`, 4-bit only."""

    @classmethod
    def quantize_int8(cls, weight: Tensor) -> GroupedWeight:
        """Symmetric int8, one scale per group: the group's largest magnitude maps to 127."""
        out, inputs = weight.shape
        groups = weight.detach().float().reshape(out, inputs // INPUTS_PER_SCALE, INPUTS_PER_SCALE)
        scales = (groups.abs().amax(dim=2) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = (groups / scales[..., None]).round().to(torch.int8).reshape(out, inputs)
        return cls(8, q.view(torch.uint8).contiguous(), scales.contiguous())

    @staticmethod
    def concat(parts: list[GroupedWeight]) -> GroupedWeight:
        """The weights of several projections stacked along the outputs (one fused projection)."""
        if len({(p.bits, p.scales.shape[1]) for p in parts}) != 1:
            raise ValueError("only weights of one format and input width can be fused")
        mins = [p.mins for p in parts]
        return GroupedWeight(
            parts[0].bits,
            torch.cat([p.data for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if mins[0] is None else torch.cat(mins),  # type: ignore[arg-type]
        )

    def rows(self, index: Tensor) -> GroupedWeight:
        """The weight's rows `index` (an embedding lookup, a reordering), still quantized."""
        mins = None if self.mins is None else self.mins[index]
        return GroupedWeight(self.bits, self.data[index], self.scales[index], mins)

    def nibbles(self) -> Tensor:
        """A 4-bit weight's values 0..15, uint8 `[out, groups, INPUTS_PER_SCALE]` in input order."""
        out, groups = self.scales.shape
        packed = self.data.reshape(out, groups, 16)
        return torch.cat([packed & 0x0F, packed >> 4], dim=2)

    def dequantize(self) -> Tensor:
        out, groups = self.scales.shape
        q = (
            self.data.view(torch.int8).reshape(out, groups, INPUTS_PER_SCALE) if self.bits == 8 else self.nibbles()
        ).float()
        w = q * self.scales[..., None] + (0 if self.mins is None else self.mins[..., None])
        return w.reshape(out, groups * INPUTS_PER_SCALE)


@dataclass(frozen=True)
class PairedWeight:
    """A GroupedWeight's bytes reordered for vattn::paired_linear: for each tile
    of TILE outputs and each group, input pair by input pair, the tile's outputs side by side
    (8-bit: two int8 each; 4-bit: one byte each, the pair's first input in the low nibble).
    Widened to int16, one pair is one vector of 16 outputs; scales and mins are `[tiles, groups,
    TILE]` to match. The same bytes as the GroupedWeight, in another order.

    For int8 activations (`activation_bits` 8, 8-bit weights only) the steps are quads: four
    inputs of each of the tile's outputs side by side, each stored as q + 128 (unsigned, as
    vpdpbusd multiplies them)."""

    bits: int
    data: Tensor
    scales: Tensor
    mins: Tensor | None = None
    activation_bits: int = 16

    @property
    def step(self) -> int:
        """Inputs per output in one step of the kernel: 2 (int16 pairs) or 4 (int8 quads)."""
        return 2 if self.activation_bits == 16 else 4

    @classmethod
    def of(cls, weight: GroupedWeight, activation_bits: int = 16) -> PairedWeight:
        out, groups = weight.scales.shape
        tiles = out // TILE
        if activation_bits == 8 and weight.bits != 8:
            raise ValueError("int8 activations run on 8-bit weights only")
        if weight.bits == 8:
            step = 2 if activation_bits == 16 else 4
            data = weight.data.reshape(tiles, TILE, groups, INPUTS_PER_SCALE // step, step).permute(0, 2, 3, 1, 4)
            if step == 4:
                data = (data.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        else:
            q = weight.nibbles()
            pairs = q[..., 0::2] | (q[..., 1::2] << 4)
            data = pairs.reshape(tiles, TILE, groups, INPUTS_PER_SCALE // 2).permute(0, 2, 3, 1)

        def tiled(values: Tensor) -> Tensor:
            return values.reshape(tiles, TILE, groups).transpose(1, 2).contiguous()

        mins = None if weight.mins is None else tiled(weight.mins)
        return cls(weight.bits, data.contiguous(), tiled(weight.scales), mins, activation_bits)

    def _signed(self) -> Tensor:
        """An 8-bit weight's q, int8 `[tiles, groups, INPUTS_PER_SCALE / step, TILE, step]`."""
        tiles, groups, _ = self.scales.shape
        data = self.data.reshape(tiles, groups, INPUTS_PER_SCALE // self.step, TILE, self.step)
        return data.view(torch.int8) if self.step == 2 else (data.to(torch.int16) - 128).to(torch.int8)

    def rows(self, index: Tensor) -> GroupedWeight:
        """The weight's rows `index` in GroupedWeight's layout (a tied embedding's lookup)."""
        tiles, groups, _ = self.scales.shape
        tile, lane = index // TILE, index % TILE
        if self.bits == 8:
            data = self._signed()[tile, :, :, lane].reshape(len(index), -1).view(torch.uint8)
        else:
            pairs = self.data.reshape(tiles, groups, INPUTS_PER_SCALE // 2, TILE)[tile, :, :, lane]
            q = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(len(index), groups, INPUTS_PER_SCALE)
            data = (q[..., :16] | (q[..., 16:] << 4)).reshape(len(index), -1)
        mins = None if self.mins is None else self.mins[tile, :, lane]
        return GroupedWeight(self.bits, data, self.scales[tile, :, lane], mins)

    def dequantize(self) -> Tensor:
        tiles, groups, _ = self.scales.shape
        if self.bits == 8:
            q = self._signed().permute(0, 3, 1, 2, 4)
        else:
            pairs = self.data.reshape(tiles, groups, INPUTS_PER_SCALE // 2, TILE).permute(0, 3, 1, 2)
            q = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1)
        q = q.reshape(tiles, TILE, groups, INPUTS_PER_SCALE).float()
        w = q * self.scales.transpose(1, 2)[..., None]
        if self.mins is not None:
            w = w + self.mins.transpose(1, 2)[..., None]
        return w.reshape(tiles * TILE, groups * INPUTS_PER_SCALE)
