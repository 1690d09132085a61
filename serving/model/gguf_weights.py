"""A GGUF file's projections as it stores them: Q8_0, Q4_0 and Q4_1 blocks become GroupedWeights.

transformers loads a GGUF by dequantizing every tensor into the model's dtype; serving that
model computes with weights the file never held (requantizing them would round twice). This
module reads the file's own blocks (the `gguf` package's reader, a memory map) and gives each
projection its `GroupedWeight`, which vattn::grouped_linear runs as stored: the answers are the
ones the GGUF defines, and the projections take the file's bytes, not fp32's.

llama.cpp's converter permutes the rows of Llama's (and Mistral's) q and k projections for its
rotary layout; rows are outputs and blocks run along inputs, so undoing the permutation moves
whole rows, exactly. Each weight is checked against transformers' dequantized one before use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from serving.model.weights import INPUTS_PER_SCALE, GroupedWeight

BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}
"""Bytes of one block of 32 weights: a float16 scale (and min, Q4_1) before the quants."""

PERMUTED_ARCHITECTURES = ("llama", "mistral")
"""Whose q and k rows llama.cpp's converter permutes (Qwen2's it leaves alone)."""


STORED_BLOCKS = "gguf_blocks/blocks.safetensors"
"""A folder converted from a GGUF keeps the file's blocks here (serving.default_model writes
it): `gguf` then serves the folder without parsing the GGUF's header at each start (10 s in the
gguf package for the default model's 49k-token vocabulary). In a subfolder: vLLM loads every
.safetensors file at the folder's top as the model's weights."""


def has_stored_blocks(model: str | None) -> bool:
    """Whether `model` carries a GGUF's blocks: a .gguf file, a folder with STORED_BLOCKS, or
    None, the default model (its conversion writes them)."""
    return model is None or model.endswith(".gguf") or (Path(model) / STORED_BLOCKS).is_file()


def attach_gguf_weights(model: Any, path: Path) -> int:
    """Sets `grouped_weight` on the token embedding and every projection of `model` whose tensor
    the GGUF file at `path` (or a converted folder's STORED_BLOCKS) holds in a supported quantized
    type, and returns how many tensors that is; the others keep their dequantized weights."""
    blocks = load_blocks(path) if path.suffix == ".safetensors" else file_blocks(model, path)
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, module, _ in projections(model, "output.weight" in blocks, heads, kv_heads):
        if name in blocks:
            module.grouped_weight = blocks[name]  # the tied embedding and head: one table
    return len(blocks)


def file_blocks(model: Any, path: Path) -> dict[str, GroupedWeight]:
    """The GGUF file's quantized tensors by name, in the model's row order, each checked against
    the model's (dequantized) weight."""
    from gguf import GGUFReader

    tensors = {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    config = model.config
    permute = config.model_type in PERMUTED_ARCHITECTURES
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    blocks: dict[str, GroupedWeight] = {}
    for name, module, rows_of_heads in projections(model, "output.weight" in tensors, heads, kv_heads):
        tensor = tensors.get(name)
        if name in blocks or tensor is None or tensor.tensor_type.name not in BLOCK_BYTES:
            continue
        weight = grouped(tensor.tensor_type.name, np.asarray(tensor.data))
        if permute and rows_of_heads:
            weight = reorder_rows(weight, unpermute_order(weight.scales.shape[0], rows_of_heads))
        expected = module.weight.detach().float()
        if weight.scales.shape[0] != expected.shape[0] or not torch.allclose(
            weight.dequantize(), expected, rtol=1e-3, atol=1e-5
        ):
            raise ValueError(f"{path.name}: tensor {name} does not match the model's {type(module).__name__} weights")
        blocks[name] = weight
    return blocks


def save_blocks(blocks: dict[str, GroupedWeight], folder: Path) -> None:
    """Writes `blocks` (file_blocks) as the folder's STORED_BLOCKS."""
    from safetensors.torch import save_file

    tensors = {}
    for name, weight in blocks.items():
        tensors |= {f"{name}.data": weight.data, f"{name}.scales": weight.scales}
        if weight.mins is not None:
            tensors[f"{name}.mins"] = weight.mins
    (folder / STORED_BLOCKS).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / STORED_BLOCKS)


def load_blocks(path: Path) -> dict[str, GroupedWeight]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    names = [key.removesuffix(".scales") for key in tensors if key.endswith(".scales")]
    blocks = {}
    for name in names:
        data, scales = tensors[f"{name}.data"], tensors[f"{name}.scales"]
        bits = 8 if data.shape[1] == scales.shape[1] * INPUTS_PER_SCALE else 4
        blocks[name] = GroupedWeight(bits, data, scales, tensors.get(f"{name}.mins"))
    return blocks


def projections(model: Any, untied_output: bool, heads: int, kv_heads: int) -> list[tuple[str, Any, int]]:
    """(GGUF tensor name, module, heads whose rows llama.cpp permuted or 0) of the token
    embedding and each projection."""
    found = [("token_embd.weight", model.model.embed_tokens, 0)]
    found += [("output.weight" if untied_output else "token_embd.weight", model.lm_head, 0)]
    for index, layer in enumerate(model.model.layers):
        attention, mlp, block = layer.self_attn, layer.mlp, f"blk.{index}"
        found += [
            (f"{block}.attn_q.weight", attention.q_proj, heads),
            (f"{block}.attn_k.weight", attention.k_proj, kv_heads),
            (f"{block}.attn_v.weight", attention.v_proj, 0),
            (f"{block}.attn_output.weight", attention.o_proj, 0),
            (f"{block}.ffn_gate.weight", mlp.gate_proj, 0),
            (f"{block}.ffn_up.weight", mlp.up_proj, 0),
            (f"{block}.ffn_down.weight", mlp.down_proj, 0),
        ]
    return found


def grouped(kind: str, raw: np.ndarray) -> GroupedWeight:
    """A GroupedWeight from a GGUF tensor's bytes `[out, blocks * BLOCK_BYTES[kind]]`."""
    out = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).reshape(out, -1, BLOCK_BYTES[kind])  # a copy: the map is read-only
    scales = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
    if kind == "Q8_0":
        return GroupedWeight(8, blocks[..., 2:].reshape(out, -1).contiguous(), scales.contiguous())
    if kind == "Q4_0":
        return GroupedWeight(4, blocks[..., 2:].reshape(out, -1).contiguous(), scales.contiguous(), -8 * scales)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    return GroupedWeight(4, blocks[..., 4:].reshape(out, -1).contiguous(), scales.contiguous(), mins.contiguous())


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row `i` of the model's weight is row `order[i]` of the file's: llama.cpp stores each
    head's rows as (pair, half) where the model has (half, pair)."""
    half = rows // heads // 2
    file_rows = torch.arange(rows).reshape(heads, half, 2).transpose(1, 2)  # the file's row at (head, half, pair)
    return file_rows.reshape(rows)


def reorder_rows(weight: GroupedWeight, order: torch.Tensor) -> GroupedWeight:
    moved = weight.rows(order)
    mins = None if moved.mins is None else moved.mins.contiguous()
    return GroupedWeight(moved.bits, moved.data.contiguous(), moved.scales.contiguous(), mins)
