"""A Llama-family forward pass over packed ragged tokens, with its KV in the vattn cache.

The weights and layers are transformers' own modules (Llama, Mistral, Qwen2, SmolLM share
this shape); only attention changes: each layer's new K/V go straight into the request
slots through the KV store's attention, which attends over views of its tensors. No HF
cache object, no concatenation or copy of past KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vattn.kernels import AttentionBatch

Attend = Callable[[int, AttentionBatch, Tensor, Tensor, Tensor], Tensor]
"""(layer, batch, q, k, v) -> attention output: stores the new K/V and attends over the cache."""

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


def load_model(path: str | Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """A causal LM and its tokenizer from a safetensors folder or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = Path(path), None
    if folder.suffix == ".gguf":
        folder, gguf_file = folder.parent, folder.name
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    if model.config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model type {model.config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    return model.eval(), tokenizer


def model_shape(model: Any) -> ModelShape:
    config = model.config
    heads = config.num_attention_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_query_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
    )


class ModelRunner:
    """Runs one iteration's tokens (prefill chunks and decodes together) through the model."""

    def __init__(self, model: Any, shape: ModelShape, attend: Attend) -> None:
        self._shape = shape
        self._model = model
        self._body = model.model
        self._attend = attend

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, batch: AttentionBatch) -> Tensor:
        """Hidden states `[tokens, hidden]` after the final norm; token positions come from the batch."""
        shape, body = self._shape, self._body
        hidden = body.embed_tokens(input_ids)
        cos, sin = body.rotary_emb(hidden, batch.token_positions[None])
        cos, sin = cos[0], sin[0]
        tokens = input_ids.shape[0]
        for index, layer in enumerate(body.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(tokens, shape.num_query_heads, shape.head_dim)
            k = attention.k_proj(x).view(tokens, shape.num_kv_heads, shape.head_dim)
            v = attention.v_proj(x).view(tokens, shape.num_kv_heads, shape.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            attended = self._attend(index, batch, q, k, v)
            hidden = hidden + attention.o_proj(attended.reshape(tokens, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return body.norm(hidden)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self._model.lm_head(hidden).float()
