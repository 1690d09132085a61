"""The model itself: loading a checkpoint, or building a synthetic one, and reading the shape the KV cache needs."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from serving.model.gguf_weights import STORED_BLOCKS, attach_gguf_weights

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


def load_model(path: str | Path, dtype: torch.dtype, gguf_weights: bool = False) -> tuple[Any, Any]:
    """A causal LM and its tokenizer from a safetensors folder or a GGUF file, or built on the
    spot for `synthetic:<name>` (serving.model.synthetic); with `gguf_weights`, a GGUF file's
    (or a folder converted from one: its STORED_BLOCKS) projections also carry its quantized
    weights as stored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.model.synthetic import is_synthetic, load_synthetic

    if is_synthetic(path):
        return load_synthetic(path, dtype)
    folder, gguf_file = Path(path), None
    if folder.suffix == ".gguf":
        folder, gguf_file = folder.parent, folder.name
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    with gguf_parsed_once() if gguf_file else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
        if model.config.model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"model type {model.config.model_type!r} is not supported; supported: {supported}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        if gguf_weights:
            attach_gguf_weights(model, folder / (gguf_file or STORED_BLOCKS))
    return model.eval(), tokenizer


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


def return_freed_memory() -> None:
    """Gives the heap's free pages back to the OS. Loading frees GBs of temporaries (a GGUF is
    dequantized whole, fp32 projections are dropped once fused or quantized) that glibc would
    otherwise keep: 1.09 GB of RSS becomes 0.51 GB for the default GGUF."""
    gc.collect()  # a loaded model's modules refer to each other: collected, not freed by refcounts
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
