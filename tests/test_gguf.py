"""A GGUF file served at its own precision: its Q4_1 and Q8_0 projections run as stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving import LLM, SamplingParams
from serving.config import EngineConfig
from serving.default_model import default_gguf, default_model_dir
from serving.model.gguf_weights import unpermute_order
from serving.model.linear import GroupedLinear
from serving.model.runner import QuantizedEmbedding

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def llamacpp_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as it writes q and k."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (8, 1)])
def test_unpermuting_rows_undoes_llamacpps_permutation(rows: int, heads: int) -> None:
    model = torch.arange(rows * 2).reshape(rows, 2)
    assert torch.equal(llamacpp_permute(model, heads)[unpermute_order(rows, heads)], model)


def test_the_default_gguf_keeps_its_quantized_weights_and_answers_as_the_float_folder() -> None:
    """The default model's folder is this GGUF dequantized: the same greedy tokens, from a
    quarter of the bytes (Q4_1 layers, the tied Q8_0 embedding and head) instead of fp32's. The
    folder keeps the file's blocks too (STORED_BLOCKS): served with `gguf`, it runs the same."""
    gguf = LLM(model=str(default_gguf()), max_slots=4, max_context=256, kv_budget=32 << 20)
    folder = LLM(dtype="float32", max_slots=4, max_context=256, kv_budget=32 << 20)
    stored = LLM(quantization="gguf", max_slots=4, max_context=256, kv_budget=32 << 20)
    try:
        assert gguf.engine.config.quantization == "gguf"
        runner = gguf.engine.executor.runner
        projections = [p for layer in runner._layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        assert all(isinstance(p, GroupedLinear) and p.weight.bits == 4 for p in projections)
        assert isinstance(runner._lm_head, GroupedLinear) and runner._lm_head.weight.bits == 8
        assert isinstance(runner._embed, QuantizedEmbedding) and runner._embed.table is runner._lm_head.weight
        assert runner._body.embed_tokens is None  # no float copy of the table is kept
        stored_bytes = sum(p.weight.data.numel() + 8 * p.weight.scales.numel() for p in projections)
        fp32 = sum(4 * p.weight.scales.numel() * 32 for p in projections)
        assert stored_bytes < fp32 / 5
        kept = stored.engine.executor.runner
        names = ("qkv", "o", "gate_up", "down")
        pairs = [
            (getattr(a, n), getattr(b, n)) for a, b in zip(kept._layers, runner._layers, strict=True) for n in names
        ]
        pairs.append((kept._lm_head, runner._lm_head))
        assert all(torch.equal(a.weight.data, b.weight.data) for a, b in pairs)
        assert all(torch.equal(a.weight.scales, b.weight.scales) for a, b in pairs)
        params = SamplingParams(max_tokens=24, temperature=0)
        quantized = [out.token_ids for out in gguf.generate(PROMPTS, params, use_tqdm=False)]
        assert quantized == [out.token_ids for out in folder.generate(PROMPTS, params, use_tqdm=False)]
        assert quantized == [out.token_ids for out in stored.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        gguf.close()
        folder.close()
        stored.close()


def test_gguf_quantization_needs_a_gguf_file_or_its_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"which holds none: pass a \.gguf file as the model"):
        EngineConfig(model=str(tmp_path), quantization="gguf")
    assert EngineConfig(quantization="gguf").quantization == "gguf"  # the default model keeps its GGUF's blocks
    # ... below its folder's top, where vLLM would load every .safetensors file as the model's weights
    assert [path.name for path in default_model_dir().glob("*.safetensors")] == ["model.safetensors"]
    assert EngineConfig(dtype="float32").quantization == "none"
    assert EngineConfig(model="/models/x.gguf").quantization == "gguf"
