"""A Llama-family forward pass over packed ragged tokens, with its KV in the KV store's cache (virtual or paged).

The weights are transformers' own (Llama, Mistral, Qwen2, SmolLM share this shape), with
the projections that read one input fused (QKV, gate/up) and optionally int8. Each
layer's new K/V go straight into the request slots through the KV store's attention,
which attends over the cache's tensors. No HF cache object, no concatenation or copy of
past KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from serving.model.linear import DenseLinear, GroupedLinear, Linear, fused, with_rows
from serving.model.loader import ModelShape
from serving.model.weights import GroupedWeight, PairedWeight
from vattn.ops import vattn_ops


class AttentionInput(Protocol):
    """What the model reads of an iteration's attention batch (the KV store's IterationBatch):
    the rest of it only the attention callback reads."""

    @property
    def token_positions(self) -> Tensor:
        """int64 `[tokens]`: each new token's position in its request, for the rotary embedding."""
        ...


Attend = Callable[[int, AttentionInput, Tensor, Tensor, Tensor], Tensor]
"""(layer, batch, q, k, v) -> attention output: stores the new K/V and attends over the cache."""
Reduce = Callable[[Tensor], Tensor]
"""Sums a tensor-parallel rank's partial projection output over the ranks (in place)."""


@dataclass(frozen=True)
class Norm:
    """A model's RMSNorm. On the CPU it runs as vattn's one-pass operators (torch's own
    is ~7 operators, more than the arithmetic at batch 1), elsewhere as torch's."""

    weight: Tensor
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module) -> Norm:
        return cls(module.weight, module.variance_epsilon)

    def __call__(self, x: Tensor) -> Tensor:
        if x.is_cpu:
            return vattn_ops().rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> Tensor:
        """`residual += x` in place, then the norm of the sum in x's dtype; on the CPU the
        residual may be float32 under a 16-bit x."""
        if x.is_cpu:
            return vattn_ops().add_rms_norm(x, residual, self.weight, self.eps)
        residual += x
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps)


class GatedActivation:
    """A gated MLP's activation of its fused gate/up output `[tokens, 2 x width]`: act(gate) * up.
    SiLU on the CPU in float32 or bfloat16 runs as vattn's one-pass operator (torch's is two,
    with a temporary)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "silu":
            self.act: Callable[[Tensor], Tensor] = F.silu
        else:  # here: importing transformers' activations is ~4 s (torch.distributed.tensor, dynamo)
            from transformers.activations import ACT2FN

            self.act = ACT2FN[name]

    def __call__(self, gate_up: Tensor) -> Tensor:
        if self.name == "silu" and gate_up.is_cpu and gate_up.dtype in (torch.float32, torch.bfloat16):
            return vattn_ops().silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


def rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q and k `[tokens, heads, head_dim]`; in place on the CPU."""
    if q.is_cpu:
        vattn_ops().rotary(q, k, cos, sin)
        return q, k
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # as ACT2FN: not at import

    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer's weights, projections that share an input fused."""

    input_norm: Norm
    qkv: Linear
    o: Linear
    post_attention_norm: Norm
    gate_up: Linear
    down: Linear


def decoder_layers(model: Any, quantization: str) -> list[DecoderLayer]:
    """The model's layers with fused QKV and gate/up projections, quantized as asked."""
    layers = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        layers.append(
            DecoderLayer(
                input_norm=Norm.of(layer.input_layernorm),
                qkv=fused([attention.q_proj, attention.k_proj, attention.v_proj], quantization),
                o=fused([attention.o_proj], quantization),
                post_attention_norm=Norm.of(layer.post_attention_layernorm),
                gate_up=fused([mlp.gate_proj, mlp.up_proj], quantization),
                down=fused([mlp.down_proj], quantization),
            )
        )
        # The fused copies replace the projections: dropped layer by layer, so that loading
        # never holds every layer's weights twice.
        for module in (attention, mlp):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(module, name, None)
    return layers


class QuantizedEmbedding:
    """An embedding table kept quantized (a GGUF's), each looked-up row dequantized."""

    def __init__(self, table: GroupedWeight | PairedWeight, dtype: torch.dtype) -> None:
        self.table, self.dtype = table, dtype

    def __call__(self, ids: Tensor) -> Tensor:
        return self.table.rows(ids).dequantize().to(self.dtype)


def largest_indices(values: Tensor, k: int, width: int = 64) -> Tensor:
    """Each row's indices of its k largest values, as `topk(k).indices` gives them (ties broken
    either way). The k largest lie in the k blocks of `width` whose maxima are largest, so topk
    runs over those blocks' values after one vectorized pass of block maxima, not over a whole
    vocabulary, which torch's topk walks element by element."""
    rows, count = values.shape
    if count % width or count // width <= k:
        return values.topk(min(k, count), dim=-1).indices
    blocked = values.view(rows, count // width, width)
    blocks = blocked.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k]
    within = blocked.gather(1, blocks[..., None].expand(rows, k, width)).view(rows, k * width)
    chosen = within.topk(k, dim=-1).indices  # positions among the k blocks' values
    return blocks.gather(1, chosen // width) * width + chosen % width


class RescoredHead:
    """The bf16 class's LM head: multiplied in bf16 on oneDNN, then each row's `CANDIDATES`
    highest logits computed again in float32 from the exact weight rows and input. Greedy
    answers hang on near-ties between the top logits, which a bf16 output rounds away: on the
    default model, 64 prompts x 64 greedy tokens (the offline workload) kept all their tokens
    equal to fp32's in 90.6% of prompts under the `bf16` preset with a float32 head, 68.8% with
    a bf16 one. Re-scored, the top logits are a float32 head's; the rest keep bf16's rounding
    (about 0.4%), and the head reads half a float32 head's bytes, which a decode step at few
    requests is bound by."""

    CANDIDATES = 8

    def __init__(self, linear: torch.nn.Linear) -> None:
        weight = linear.weight.detach()
        self.exact = weight.contiguous()
        """Rows gathered and widened to float32: a bfloat16 model's own weight, or a float model's."""
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.fast = DenseLinear(weight.to(torch.bfloat16), None)

    def rows_for(self, rows: int) -> int:
        return self.fast.rows_for(rows)

    def __call__(self, x: Tensor) -> Tensor:
        logits = self.fast(x.to(torch.bfloat16)).float()
        top = largest_indices(logits, self.CANDIDATES)
        exact = torch.einsum("rch,rh->rc", self.exact[top].float(), x.float())
        if self.bias is not None:
            logits += self.bias
            exact += self.bias[top]
        return logits.scatter_(-1, top, exact)


def lm_head(linear: torch.nn.Linear, quantization: str) -> Linear:
    """The LM head: under `bf16`, and for a bfloat16 model on the CPU, bf16 with its top
    logits in float32 (RescoredHead); otherwise as the projections are (fused)."""
    on_cpu = linear.weight.device.type == "cpu"
    if on_cpu and (quantization == "bf16" or (quantization == "none" and linear.weight.dtype == torch.bfloat16)):
        return RescoredHead(linear)
    return fused([linear], quantization)


class ModelRunner:
    """Runs one iteration's tokens (prefill chunks and decodes together) through the model.

    The model's own modules serve the embedding (a GGUF's stays quantized) and the rotary tables; norms (each fused
    with the residual add before it) and the rotation run as `Norm` and `rotate`, the
    projections as fused (and optionally bf16 or int8) ones, and the original projections
    are dropped.
    """

    def __init__(
        self, model: Any, shape: ModelShape, attend: Attend, quantization: str = "none", reduce: Reduce | None = None
    ) -> None:
        self._shape = shape
        self._reduce: Reduce = reduce or (lambda x: x)
        """Tensor parallelism: the output and down projections' partial sums, summed over the ranks."""
        self._body = body = model.model
        self._layers = decoder_layers(model, quantization)
        self._activation = GatedActivation(model.config.hidden_act)
        self._final_norm = Norm.of(body.norm)
        self._lm_head = lm_head(model.lm_head, quantization)
        self._embed = body.embed_tokens
        stored = getattr(body.embed_tokens, "grouped_weight", None) if quantization == "gguf" else None
        if stored is not None:  # the GGUF's own table, rows dequantized as looked up: no float copy kept
            head = self._lm_head
            tied = isinstance(head, GroupedLinear) and getattr(model.lm_head, "grouped_weight", None) is stored
            # A tied head's weight may be held paired (PairedWeight): the table reads its rows there.
            self._embed = QuantizedEmbedding(head.weight if tied else stored, body.embed_tokens.weight.dtype)
            body.embed_tokens = None
        body.layers = torch.nn.ModuleList()  # the fused copies replace them
        self._attend = attend

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, batch: AttentionInput) -> Tensor:
        """Hidden states `[tokens, hidden]` after the final norm; token positions come from the batch."""
        shape, body = self._shape, self._body
        tokens = input_ids.shape[0]
        # Where the projections pad a call's rows (DenseLinear on oneDNN's packed matmul), the
        # iteration runs at the padded count, so that they need not copy their inputs to pad them
        # (those copies were 6.5% of a 2,000-token prompt step on an AMX Xeon). Attention sees the real rows only.
        rows = self._layers[0].qkv.rows_for(tokens)
        positions = batch.token_positions
        if rows != tokens:
            input_ids, positions = F.pad(input_ids, (0, rows - tokens)), F.pad(positions, (0, rows - tokens))
        hidden = self._embed(input_ids)
        cos, sin = body.rotary_emb(hidden, positions[None])
        cos, sin = cos[0], sin[0]
        q_width = shape.num_query_heads * shape.head_dim
        kv_width = shape.num_kv_heads * shape.head_dim
        # A 16-bit model's residual stream is summed in float32 on the CPU (the norms read it and
        # write the model's dtype): summed in bf16, its rounding over 30 layers parted the default
        # model's greedy answers from fp32's in 15 of the offline workload's 64 prompts; 6 now.
        residual = hidden.float() if hidden.is_cpu else hidden
        normed = self._layers[0].input_norm(hidden)
        for index, layer in enumerate(self._layers):
            q, k, v = layer.qkv(normed).split([q_width, kv_width, kv_width], dim=-1)
            q = q.view(rows, shape.num_query_heads, shape.head_dim)
            k = k.view(rows, shape.num_kv_heads, shape.head_dim)
            v = v.view(rows, shape.num_kv_heads, shape.head_dim)
            q, k = rotate(q, k, cos, sin)
            attended = self._attend(index, batch, q[:tokens], k[:tokens], v[:tokens]).reshape(tokens, -1)
            attention_out = self._reduce(layer.o(attended if rows == tokens else with_rows(attended, rows)))
            normed = layer.post_attention_norm.add_and_norm(attention_out, residual)
            mlp_out = self._reduce(layer.down(self._activation(layer.gate_up(normed))))
            following = self._layers[index + 1].input_norm if index + 1 < len(self._layers) else self._final_norm
            normed = following.add_and_norm(mlp_out, residual)
        return normed[:tokens]

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self._lm_head(hidden).float()
