"""Random-weight Llama models built on the spot, for machines that can neither download nor carry one.

A model path spelled `synthetic:<name>` (EngineConfig.model, `vattn serve --model`) builds the
model of SYNTHETIC_MODELS called `name` (serving.model.llama's tree, as a checkpoint is), with
weights drawn from a seeded torch.Generator, and a byte-level BPE tokenizer made in code.
Nothing is read from disk or the network, and two builds are equal to the bit.

The weights are rounded to bfloat16 whatever the dtype, so a float32 and a bfloat16 engine
hold the same numbers and differ only in their arithmetic. Their scales keep greedy
decoding informative: the embedding has unit scale and every projection 1/sqrt(fan_in), so no
sublayer drowns the token's own embedding in the residual stream; q and k are sqrt(2) times
that, for attention scores of std ~2, so attention picks positions rather than averaging
them all (a kernel that reads the wrong keys changes the tokens).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import torch

from serving.model.llama import CausalLM, ModelConfig

PREFIX = "synthetic:"

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
"""Last in the vocabulary: beginning of text (bos), end of text (eos), and ChatML's turn markers
(the end of a turn is an eos too)."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class SyntheticModel:
    """A Llama shape; head_dim need not be hidden_size / num_query_heads (q and o project across)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    seed: int = 0


SYNTHETIC_MODELS = {
    # ~10M parameters: the CPU tests' model. Head dim 64, as FlashInfer needs (it has no 32).
    "tiny": SyntheticModel(
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_query_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1024,
        max_position=4096,
    ),
    # The paper's attention (Llama-2-7B's heads with Llama-3's GQA: 32 query heads over 8 KV
    # heads of 128) in 4 layers and a narrower residual: ~260M parameters, 0.5 GB in bfloat16.
    "paper": SyntheticModel(
        num_layers=4,
        hidden_size=2048,
        intermediate_size=5632,
        num_query_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=8192,
        max_position=32768,
    ),
    # The default model's shape (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of 64,
    # 49,152 tokens): its speed where its weights cannot travel (a lent GPU machine's host CPU).
    "smollm2": SyntheticModel(
        num_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_query_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position=8192,
    ),
}


def is_synthetic(path: object) -> bool:
    return str(path).startswith(PREFIX)


def synthetic_spec(path: object) -> SyntheticModel:
    """The configuration `synthetic:<name>` names; ValueError listing the names otherwise."""
    name = str(path).removeprefix(PREFIX)
    if not is_synthetic(path) or name not in SYNTHETIC_MODELS:
        choices = ", ".join(PREFIX + known for known in SYNTHETIC_MODELS)
        raise ValueError(f"unknown synthetic model {str(path)!r}; choose one of {choices}")
    return SYNTHETIC_MODELS[name]


def load_synthetic(path: object, dtype: torch.dtype) -> tuple[CausalLM, Any]:
    """The causal LM and tokenizer `synthetic:<name>` names, weights in `dtype` on the CPU."""
    spec = synthetic_spec(path)
    return build_model(spec, dtype), build_tokenizer(spec.vocab_size)


def model_config(spec: SyntheticModel) -> ModelConfig:
    _, eos, _, end_of_turn = special_token_ids(spec.vocab_size)
    return ModelConfig(
        model_type="llama",
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_query_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_ids=(eos, end_of_turn),
    )


def build_model(spec: SyntheticModel, dtype: torch.dtype) -> CausalLM:
    """The model of `spec`, its weights drawn in the order transformers names them from a generator
    seeded with `spec.seed`."""
    config = model_config(spec)
    generator = torch.Generator().manual_seed(spec.seed)
    weights = {}
    for name, parameter in CausalLM(config).named_parameters():  # on the meta device: the names and shapes
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(parameter.shape)
            continue
        fan_in = parameter.shape[-1]
        std = 1.0 if "embed_tokens" in name else fan_in**-0.5
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            std *= 2**0.5
        weights[name] = torch.randn(parameter.shape, generator=generator).mul_(std).to(torch.bfloat16)
    return CausalLM.of(config, weights, dtype)


def special_token_ids(vocab_size: int) -> tuple[int, ...]:
    """The ids of SPECIAL_TOKENS: the vocabulary's last ones."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return tuple(range(first, vocab_size))


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of `vocab_size` tokens (the 256 bytes, merges, SPECIAL_TOKENS),
    wrapped for transformers with bos, eos and a ChatML chat template. Every text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    byte_chars = byte_level_alphabet()
    merges = byte_level_merges(vocab_size - len(byte_chars) - len(SPECIAL_TOKENS))
    vocab = {char: i for i, char in enumerate(byte_chars)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    bos, eos, _, _ = SPECIAL_TOKENS
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab_size - len(SPECIAL_TOKENS))]
    )
    assert core.get_vocab_size() == vocab_size
    return TokenizersBackend(
        tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=eos, chat_template=CHAT_TEMPLATE
    )


def byte_level_alphabet() -> list[str]:
    """GPT-2's characters for the bytes 0..255, in byte order: printable ones stand for
    themselves, the others (space, control bytes) for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def byte_level_merges(count: int) -> list[tuple[str, str]]:
    """`count` BPE merges made up in a fixed order: a letter after a space or a letter ("Ġt",
    "he"), then a lower-case letter after each of those ("Ġth", "her"), then after each of
    those ("Ġthe", "here"). English-looking text
    takes ~2 characters a token; any text still round-trips byte by byte."""
    space = byte_level_alphabet()[ord(" ")]
    lower, upper = string.ascii_lowercase, string.ascii_uppercase
    pairs = [(a, b) for a in (space, *lower, *upper) for b in lower] + [(space, b) for b in upper]
    triples = [(a + b, c) for a, b in pairs for c in lower]
    quadruples = [(a + b, c) for a, b in triples[: max(0, count - len(pairs) - len(triples))] for c in lower]
    merges = (pairs + triples + quadruples)[:count]
    if len(merges) < count:
        raise ValueError(f"a vocabulary of {count} merges is more than this tokenizer makes up ({len(merges)})")
    return merges
