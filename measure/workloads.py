"""The workloads the benchmarks and the paper's experiments send: seeded prompts, long text,
and the engine configurations compared."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from measure.results import REPO_ROOT
from serving import LLM
from serving.default_model import ensure_default_model

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "w8": {"dtype": "float32", "quantization": "int8_weight_only"},
    "q8": {"dtype": "float32", "quantization": "q8_0", "kv_cache_dtype": "float16"},  # llama.cpp Q8_0's, f16 KV
    "f16kv": {"dtype": "float32", "kv_cache_dtype": "float16"},  # fp32 weights and compute, f16 KV
    "int8kv": {"dtype": "float32", "kv_cache_dtype": "int8"},  # fp32 weights, int8 KV (asymmetric per token and head)
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "bf16w": {"dtype": "float32", "quantization": "bf16"},
    "bf16": {"dtype": "bfloat16"},
    "bf16kv8": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},  # a bfloat16 model over an int8 KV cache
    "default": {},  # dtype auto: bfloat16 where the CPU multiplies bf16 natively, else fp32 on the GGUF's blocks
}


def engine_options(name: str) -> dict[str, Any]:
    """`LLM` keyword arguments of configuration `name`, on the default model's folder (`gguf`:
    the blocks of its GGUF file, Q4_1 layers and a Q8_0 head, that the folder keeps)."""
    return dict(CONFIGS[name])


WORDS = [
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
]


def random_token_prompts(count: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token ids (past the special tokens), lengths uniform in [shortest, longest]."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(100, vocab, (n,), generator=generator).tolist() for n in lengths]


def random_word_prompts(count: int, shortest: int, longest: int, seed: int) -> list[str]:
    """Seeded prompts of common English words, lengths uniform in [shortest, longest]."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(shortest, longest))) for _ in range(count)]


def long_prompt(llm: LLM, tokens: int) -> list[int]:
    """Ordinary English text (this repository's README, repeated) cut to `tokens` ids."""
    text = (REPO_ROOT / "README.md").read_text()
    ids: list[int] = []
    while len(ids) < tokens:
        ids += llm.tokenizer(text)["input_ids"]
    return ids[:tokens]


def small_llama(folder: Path, seed: int = 0) -> Path:
    """A Llama of random weights whose heads split over 2 ranks (4 query heads, 2 KV heads, 2
    layers, hidden 128) with the default model's tokenizer, saved into `folder`: what the tensor
    parallelism test and benchmark run (the default model's 3 KV heads divide by no size > 1).
    Weights 4x the init's, so that greedy tokens are far from ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49_152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder / name)
    return folder
