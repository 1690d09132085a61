"""EngineConfig: the precision `auto` picks, and KV precisions no kernel can read refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from serving.config import EngineConfig
from serving.model.cpu_features import bf16_native, cpu_kernels


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, float16, bfloat16, int8"),
        ({"kv_cache_dtype": "int8", "dtype": "float16"}, r"needs a float32 model \(int8 also a bfloat16 one\)"),
        ({"kv_cache_dtype": "int8", "kernel": "sdpa"}, "int8 is read only by the ragged and paged kernels"),
        ({"kv_cache_dtype": "int8", "kv_cache": "paged", "kernel": "paged_gather"}, "runs paged_gather"),
        ({"dtype": "int8"}, "dtype must be one of auto, float16, bfloat16, float32"),
        ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "needs a float32 model"),
        ({"kv_cache_dtype": "float16", "kernel": "sdpa"}, "read only by the ragged kernel"),
        ({"kv_cache_dtype": "bfloat16", "kv_cache": "paged", "dtype": "float32"}, "read only by the ragged kernel"),
    ],
)
def test_a_kv_cache_dtype_nothing_can_read_is_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_auto_precision_takes_bfloat16_where_the_cpu_runs_bf16_natively() -> None:
    """`dtype` auto (the default): bfloat16 on a CPU with AVX512_BF16 or AMX, float32 elsewhere
    (over a float16 KV cache where the ragged kernel reads one with SIMD, and on the blocks of
    the GGUF the default model was converted from where AVX2 runs them), float32 throughout
    under tensor parallelism and with a quantization or another KV precision asked for, bfloat16
    on a GPU; an explicit float32 (its KV too), or any explicit quantization, is kept as asked."""
    auto = EngineConfig()
    assert auto.dtype == ("bfloat16" if bf16_native() else "float32")
    narrow_kv = not bf16_native() and cpu_kernels() != "scalar"
    assert auto.kv_torch_dtype == (torch.float16 if narrow_kv else auto.torch_dtype)
    assert auto.quantization == ("gguf" if narrow_kv else "none")  # the default model's own blocks
    kv_as_the_model = ({"quantization": "q8_0"}, {"kv_cache": "paged"}, {"kernel": "sdpa"}, {"tensor_parallel_size": 2})
    for as_the_model in kv_as_the_model:
        config = EngineConfig(**as_the_model)
        assert config.kv_torch_dtype == config.torch_dtype, as_the_model
    assert EngineConfig(dtype="float32").kv_torch_dtype == torch.float32
    assert EngineConfig(quantization="q8_0").dtype == "float32"
    assert EngineConfig(kv_cache_dtype="int8").dtype == "float32"
    assert EngineConfig(dtype="float32").quantization == "none"
    assert EngineConfig(quantization="q8_0").quantization == "q8_0"
    assert EngineConfig(model="/models/x.gguf").quantization == "gguf"
    assert EngineConfig(model="/models/plain-folder").quantization == "none"  # no GGUF blocks beside it
    assert EngineConfig(backend="cuda").dtype == "bfloat16"
    assert EngineConfig(tensor_parallel_size=2).dtype == "float32"  # every rank alike, whatever its CPU
