"""The model itself: loading a checkpoint, or building a synthetic one, and reading the shape the KV cache needs."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from serving.model.gguf_weights import STORED_BLOCKS, attach_gguf_weights
from serving.model.llama import CausalLM, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_config.json's classes that are a tokenizer.json as it is (one class in transformers 5)."""


def load_model(path: str | Path, dtype: torch.dtype, gguf_weights: bool = False) -> tuple[CausalLM, Any]:
    """A causal LM and its tokenizer from a safetensors folder or a GGUF file, or built on the
    spot for `synthetic:<name>` (serving.model.synthetic); with `gguf_weights`, a GGUF file's
    (or a folder converted from one: its STORED_BLOCKS) projections also carry its quantized
    weights as stored."""
    from serving.model.synthetic import is_synthetic, load_synthetic

    if is_synthetic(path):
        return load_synthetic(path, dtype)
    folder, gguf_file = Path(path), None
    if folder.suffix == ".gguf":
        folder, gguf_file = folder.parent, folder.name
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    if gguf_file:
        model, tokenizer = load_gguf(folder / gguf_file, dtype)
    else:
        model, tokenizer = CausalLM.of(read_config(folder), read_weights(folder), dtype), load_tokenizer(folder)
    if gguf_weights:
        attach_gguf_weights(model, folder / (gguf_file or STORED_BLOCKS))
    return model, tokenizer


def read_config(folder: Path) -> ModelConfig:
    """config.json, its end-of-sequence ids generation_config.json's where it names some (as
    transformers' generation does)."""
    generation = folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    return ModelConfig.from_dict(json.loads((folder / "config.json").read_text()), eos)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, as transformers finds them: the shards that
    model.safetensors.index.json names, else model.safetensors, else every .safetensors file at
    the folder's top."""
    from safetensors.torch import load_file

    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} holds no .safetensors weights")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer; a plain tokenizer.json without transformers' AutoTokenizer, whose
    import alone is ~2 s (it indexes every model transformers knows)."""
    settings = folder / "tokenizer_config.json"
    if settings.is_file() and json.loads(settings.read_text()).get("tokenizer_class") in FAST_TOKENIZERS:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[CausalLM, Any]:
    """A GGUF file's model, dequantized by transformers, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    eos = loaded.generation_config.eos_token_id if loaded.generation_config is not None else None
    return CausalLM.of(ModelConfig.from_dict(loaded.config.to_dict(), eos), loaded.state_dict(), dtype), tokenizer


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While a GGUF loads, one `gguf.GGUFReader` per file and one tensor-name map per
    architecture. transformers opens a new reader for the config, the tokenizer and the weights
    (and `attach_gguf_weights` a fourth), each parsing the whole header in Python (the default
    GGUF's 49k-token vocabulary: seconds apiece), and builds gguf's tensor-name map once per
    module (397 times for the default model): 28 s of loading on a 2-core VM, most of it
    these. Both are looked up by name from `gguf` at each call, so this swaps them there."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def model_shape(model: CausalLM) -> ModelShape:
    config = model.config
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_query_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
    )
