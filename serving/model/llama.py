"""The Llama family's weights (Llama, Mistral, Qwen2, SmolLM) as the module tree their
checkpoints name (`model.layers.0.self_attn.q_proj.weight`, ...), and the configuration
that shapes it.

The tree only holds weights: ModelRunner fuses its projections and runs the forward pass.
transformers builds the same tree, but importing its configuration and modeling code costs
4-6 s a process on a 2-core VM (torch.distributed.tensor and dynamo, through its kernel hub)
before any weight is read, and each server start paid it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary embeddings whose tables do not change with the sequence's length."""


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's config.json, the fields the tree and the runner read; the names are
    transformers' (its rotary functions read them)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any]
    """transformers' standard form: `rope_type`, `rope_theta` and the type's own keys."""
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_eos: int | list[int] | None = None) -> ModelConfig:
        """From config.json's fields, in transformers' current form or the older one (`rope_theta`
        and `rope_scaling` beside the others), the end-of-sequence ids the generation config's
        where it names some (as transformers' generation takes them); ValueError for what the
        tree cannot hold."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in raw:
            rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if rope["rope_type"] in ("llama3", "yarn"):
            original = raw.get("original_max_position_embeddings", raw["max_position_embeddings"])
            rope.setdefault("original_max_position_embeddings", original)
        # Qwen2's q/k/v carry biases whatever its config says; Llama's four projections follow
        # `attention_bias`; Mistral's have none.
        attention_bias = bool(raw.get("attention_bias", False)) and model_type == "llama"
        eos = generation_eos if generation_eos is not None else raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            hidden_act=raw.get("hidden_act", "silu"),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            rope_parameters=rope,
            qkv_bias=attention_bias or model_type == "qwen2",
            output_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) and model_type == "llama",
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    def standardize_rope_params(self) -> None:
        """transformers' rotary functions ask their config for this; `from_dict` did it."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """cos and sin `[batch, tokens, head_dim]` of each position, in the input's dtype."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rope_type = config.rope_parameters["rope_type"]
        if rope_type == "default":
            dim = config.head_dim
            base = config.rope_parameters["rope_theta"]
            inv_freq, self.attention_scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # a light module: no modeling code

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def _linear(inputs: int, outputs: int, bias: bool) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=bias, device="meta").requires_grad_(False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, head_dim, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.q_proj = _linear(hidden, config.num_attention_heads * head_dim, bias)
        self.k_proj = _linear(hidden, config.num_key_value_heads * head_dim, bias)
        self.v_proj = _linear(hidden, config.num_key_value_heads * head_dim, bias)
        self.o_proj = _linear(config.num_attention_heads * head_dim, hidden, config.output_bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, width, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _linear(hidden, width, bias)
        self.up_proj = _linear(hidden, width, bias)
        self.down_proj = _linear(width, hidden, bias)


class Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Body(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Given its (meta) weight: an Embedding's own initialisation imports dynamo (~2 s) on meta.
        table = torch.empty(config.vocab_size, config.hidden_size, device="meta")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table).requires_grad_(False)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """The tree, its parameters in the order transformers' LlamaForCausalLM names them."""

    def __init__(self, config: ModelConfig) -> None:
        """Every weight on the meta device (no memory): `load` or `to_empty` gives them some."""
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def of(cls, config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype) -> CausalLM:
        """The tree holding a checkpoint's `weights` by name, each in `dtype` (taken out of the
        dict as they are converted: a conversion never holds two copies of every weight);
        ValueError naming the weights missing or unknown. A tied head is the embedding."""
        model = cls(config)
        tied = config.tie_word_embeddings
        expected = {name for name, _ in model.named_parameters()}  # a tied head's weight named once, as the embedding
        given = set(weights) - ({"lm_head.weight"} if tied else set())
        if missing := sorted(expected - given):
            raise ValueError(f"the checkpoint lacks {len(missing)} weights the model needs: {', '.join(missing[:4])}")
        if unknown := sorted(given - expected):
            raise ValueError(f"the checkpoint holds {len(unknown)} unknown weights: {', '.join(unknown[:4])}")
        for name in expected:
            module_name, _, attribute = name.rpartition(".")
            weight = weights.pop(name).to(dtype)
            setattr(model.get_submodule(module_name), attribute, nn.Parameter(weight, requires_grad=False))
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight  # the loaded table, not the meta one
        return model.eval()
