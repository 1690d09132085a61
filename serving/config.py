"""How an engine is built: which model, its precision, and the sizes of its KV cache and batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.model.cpu_features import bf16_native, bf16_widened, cpu_kernels
from serving.model.gguf_weights import has_stored_blocks
from vattn.backends.host import max_map_count
from vattn.config import DTYPES, KVCacheConfig
from vattn.kernels import KERNELS
from vattn.paged import PAGED_KERNELS
from vattn.sizes import KiB, MiB
from vattn.validate import is_int, require_positive_int

KV_CACHES = ("virtual", "paged")
MODEL_DTYPES = {name: dtype for name, dtype in DTYPES.items() if dtype.is_floating_point}
"""The model's precisions (the KV cache's may also be int8)."""
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "int8")
QUANTIZATIONS = ("none", "bf16", "int8", "int8_weight_only", "q8_0", "gguf")
"""The projections' arithmetic (serving.model.linear.make_linear): as the weights, or one of these presets."""


MAP_COUNT_SHARE = 0.6
"""The most of vm.max_map_count a default host page size lets one cache's pages need."""


def host_page_size(kv_budget: int) -> int:
    """The host cache's default page: 64 KiB, doubled until the budget's pages, each of which
    may take two memory mappings (its own, and the split of the reservation around it), need at
    most MAP_COUNT_SHARE of vm.max_map_count. Under the usual limit (65,530) a 2 GiB budget gets
    128 KiB pages, where 64 KiB ones are refused at start."""
    page, limit = 64 * KiB, max_map_count() * MAP_COUNT_SHARE
    while 2 * (kv_budget // page) > limit:
        page *= 2
    return page


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """A safetensors folder or .gguf file, or `synthetic:<name>` (a random-weight model built on the
    spot, serving.model.synthetic); None is the default model (fetched on first use)."""
    dtype: str = "auto"
    """The model's precision: `float32` (exact), `bfloat16`, `float16`, or `auto`: on the CPU
    bfloat16 (weights, activations, KV cache; the LM head's top logits re-scored in float32) where the CPU runs bf16
    natively (AVX512_BF16, AMX: `serving.model.cpu_features.bf16_native`) and neither a quantization
    nor another KV precision is asked for, measured near-lossless (benchmarks/README,
    `quality_bf16`) and the fastest of the bf16 class offline; float32 elsewhere, over a float16
    KV cache where the ragged kernel reads one (AVX2, AVX-512) and neither a quantization nor a KV
    precision is asked for (half the bytes a decode step's attention reads; every greedy answer
    of fp32's kept, benchmarks/README), and with a model that carries its GGUF's blocks (the
    default model, a converted folder: quantization `gguf`) its projections run on them, prompts
    in float32 on the dequantized weights and decoding rows from the file's bytes; float32
    throughout under tensor parallelism (ranks on other machines must compute alike); bfloat16
    on a GPU. `float32` asked for is exact: its KV and projections too."""
    max_slots: int = 64
    """Requests running at once (KV slots)."""
    max_context: int = 2048
    """Prompt plus output tokens of one request (capped at the model's own limit)."""
    max_batched_tokens: int = 2048
    """Tokens one iteration computes: prefill chunks plus decodes. vLLM's CPU build's default for its
    server: larger prefill batches run the projections nearer the matmul library's peak."""
    reserve_tokens: int = 128
    """Output tokens of every running request that admission keeps room for (serving.scheduler):
    more admits more requests at once, and risks more preemptions when they all run long."""
    kv_budget: int = 1024 * MiB
    """Physical bytes the KV cache may map."""
    kv_preallocate: bool = True
    """Allocate the virtual cache's pages (up to kv_budget, or what max_slots requests at max_context
    can use) when the engine starts, as vLLM and OpenVINO allocate their KV space: no step pays for
    touching fresh memory, and a budget the machine cannot hold fails at start. False: pages get
    memory when first mapped, and the cache costs only what it maps (not with several models on one budget)."""
    kv_cache: str = "virtual"
    """`virtual` (vattn's cache) or `paged` (the block-table baseline)."""
    page_size: int | None = None
    """The virtual cache's physical page size; None: 2 MiB (CUDA's allocation granularity) on
    CUDA, on the host `host_page_size(kv_budget)` (64 KiB up to a budget of about 1.2 GiB)."""
    block_size: int = 16
    """The paged cache's tokens per block."""
    prefix_caching: bool | None = None
    """Map the KV pages of prompt prefixes seen before instead of computing them (the
    virtual cache only); None: on for the virtual cache, off for the paged one."""
    prefix_match: str = "token"
    """A cached prefix reused to the token or in whole units (see vattn's KVCacheConfig.prefix_match)."""
    prefix_cache_share: float = KVCacheConfig.prefix_cache_share
    """The most of `kv_budget` that cached prefixes no running request maps may hold (see vattn's
    KVCacheConfig.prefix_cache_share); 1.0 keeps them until their pages are needed, as vLLM does."""
    kv_events_endpoint: str | None = None
    """Publish the prefix cache's stores and evictions here as vLLM's KV events (ZMQ PUB,
    serving.kv_events), e.g. tcp://*:5557; None: not published."""
    kv_events_replay_endpoint: str | None = None
    """A ZMQ ROUTER endpoint that replays buffered event batches from a sequence number on."""
    kv_events_topic: str = ""
    backend: str = "host"
    kernel: str = "auto"
    """Attention kernel: virtual cache, vattn.kernels.KERNELS (`auto`: `ragged` on the host,
    `sdpa` on CUDA); paged cache, vattn.paged.PAGED_KERNELS (`auto`: `paged` on the host,
    `paged_flashinfer` on CUDA)."""
    quantization: str = "auto"
    """Weights (serving.model.linear): `none` (as `dtype`), `bf16`, `int8`, `int8_weight_only`, `q8_0`,
    or `gguf` (a GGUF file's quantized weights as stored, or a folder converted from one: see
    serving.model.gguf_weights.STORED_BLOCKS); `auto`: `gguf` for a GGUF file (and, with `dtype`
    auto, where it resolves to float32 for a folder that keeps its GGUF's blocks), else `none`."""
    kv_cache_dtype: str = "auto"
    """The KV cache's precision (vLLM's --kv-cache-dtype): `auto` is `dtype`; `float16` (llama.cpp's
    default KV type) or `bfloat16` halve a float32 model's KV bytes, and with them the bytes a
    decode step's attention reads; `int8` a quarter (a bfloat16 model's: half). Only the ragged
    kernel reads a cache of another precision than the model's (int8: the paged kernel too)."""
    tensor_parallel_size: int = 1
    """Ranks that split every layer's heads and MLP columns, each with its own KV cache for its
    KV heads (serving.model.tensor_parallel; `kv_budget` is each rank's); it must divide the KV heads."""
    tp_init_method: str | None = None
    """Where the ranks meet (torch.distributed's `tcp://host:port`); None: on this machine, the
    other ranks started by rank 0 on a free loopback port."""
    seed: int = 0
    """Random stream of requests that give no seed of their own."""
    enable_sleep_mode: bool = False
    """vLLM's sleep mode: `LLMEngine.sleep` gives the KV cache's pages back to the system (and at
    level 2 drops the weights) while the address space stays reserved; the virtual cache only."""

    def __post_init__(self) -> None:
        require_positive_int("max_batched_tokens", self.max_batched_tokens)
        if not is_int(self.reserve_tokens) or self.reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be an integer >= 0, got {self.reserve_tokens!r}")
        is_gguf = str(self.model or "").endswith(".gguf")
        if self.dtype == "auto":
            single = self.tensor_parallel_size == 1  # ranks on other machines must not choose otherwise
            asked = self.quantization != "auto" or self.kv_cache_dtype not in ("auto", "bfloat16")
            native = not asked and single and not is_gguf and bf16_native()
            object.__setattr__(self, "dtype", "bfloat16" if self.backend == "cuda" or native else "float32")
            if self.dtype == "float32" and not asked and single and not is_gguf:
                if self._reads_float16_kv_fast():
                    object.__setattr__(self, "kv_cache_dtype", "float16")
                if cpu_kernels() != "scalar" and has_stored_blocks(self.model):
                    object.__setattr__(self, "quantization", "gguf")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {self.kv_cache!r}")
        require_positive_int("block_size", self.block_size)
        if self.prefix_caching is None:
            object.__setattr__(self, "prefix_caching", self.kv_cache == "virtual")
        elif self.prefix_caching and self.kv_cache != "virtual":
            raise ValueError("prefix caching shares the virtual cache's pages: the paged baseline has none")
        if self.kv_events_endpoint is not None and not self.prefix_caching:
            raise ValueError(
                "KV events announce the prefix cache's units: they need prefix caching on the virtual cache"
            )
        if self.kv_events_endpoint is None and self.kv_events_replay_endpoint is not None:
            raise ValueError("a KV events replay endpoint needs kv_events_endpoint too")
        if self.page_size is None:
            object.__setattr__(self, "page_size", 2 * MiB if self.backend == "cuda" else host_page_size(self.kv_budget))
        kernels = KERNELS if self.kv_cache == "virtual" else PAGED_KERNELS
        if self.kernel != "auto" and self.kernel not in kernels:
            raise ValueError(
                f"kernel {self.kernel!r} does not run on the {self.kv_cache} KV cache; "
                f"choose auto or one of {', '.join(kernels)}"
            )
        self._check_kv_cache_dtype()
        if self.quantization == "auto":
            object.__setattr__(self, "quantization", "gguf" if is_gguf else "none")
        if self.quantization not in QUANTIZATIONS:
            choices = ", ".join(("auto", *QUANTIZATIONS))
            raise ValueError(f"quantization must be one of {choices}, got {self.quantization!r}")
        if self.quantization == "gguf" and not has_stored_blocks(self.model):
            raise ValueError(
                f"quantization 'gguf' keeps a GGUF file's weights, but the model is the folder {self.model}, "
                "which holds none: pass a .gguf file as the model, or choose another quantization"
            )
        require_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and self.quantization == "gguf":
            raise ValueError("tensor parallelism splits a float checkpoint's projections: not a GGUF file's blocks")
        if self.enable_sleep_mode and (self.kv_cache != "virtual" or self.tensor_parallel_size > 1):
            raise ValueError(
                "sleep mode gives the virtual cache's pages back on one rank: it needs kv_cache 'virtual' and "
                "tensor_parallel_size 1 (the paged baseline's blocks are allocated once, for good)"
            )

    def _reads_float16_kv_fast(self) -> bool:
        """Whether this configuration's attention reads a float16 KV cache with SIMD (F16C):
        the ragged kernel on the host's virtual cache, on an AVX2 or AVX-512 CPU."""
        virtual = self.backend == "host" and self.kv_cache == "virtual"
        kernel = KERNELS.get(self.attention_kernel)  # an unknown one is refused after
        return virtual and kernel is not None and kernel.reads_narrower_cache and cpu_kernels() != "scalar"

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype in ("auto", self.dtype):
            return
        if self.dtype != "float32" and not (self.dtype == "bfloat16" and self.kv_cache_dtype == "int8"):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} needs a float32 model (int8 also a bfloat16 one); with dtype "
                f"{self.dtype}, use kv_cache_dtype auto"
            )
        kernel, int8 = self.attention_kernel, self.kv_cache_dtype == "int8"
        if int8:  # the virtual cache's and the paged baseline's own CPU kernels
            readers = [name for name, k in {**KERNELS, **PAGED_KERNELS}.items() if k.reads_int8_cache]
            if kernel not in readers:
                raise ValueError(
                    f"kv_cache_dtype int8 is read only by the {' and '.join(readers)} kernels (virtual and paged "
                    f"cache, host backend); this configuration runs {kernel}: use kv_cache_dtype auto, or one of them"
                )
            return
        if self.kv_cache != "virtual" or not KERNELS[kernel].reads_narrower_cache:
            readers = ", ".join(name for name, k in KERNELS.items() if k.reads_narrower_cache)
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} is read only by the {readers} kernel on the virtual cache "
                f"(host backend); this configuration runs {kernel} on the {self.kv_cache} cache: use "
                f"kv_cache_dtype auto, or kernel {readers}"
            )

    @property
    def attention_kernel(self) -> str:
        """The kernel `kernel` names, `auto` resolved for this cache and backend."""
        if self.kernel != "auto":
            return self.kernel
        if self.kv_cache == "virtual":
            return "ragged" if self.backend == "host" else "sdpa"
        return "paged" if self.backend == "host" else "paged_flashinfer"

    @property
    def torch_dtype(self) -> torch.dtype:
        return MODEL_DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]

    @property
    def projections(self) -> str:
        """How the projections multiply, as the server announces it: bf16 weights widened to
        float32 where oneDNN's bf16 matmul is the slower (serving.model.linear.DenseLinear.widens)."""
        bf16_weights = self.quantization == "bf16" or (self.quantization == "none" and self.dtype == "bfloat16")
        if bf16_weights and self.backend == "host" and bf16_widened():
            return "bf16 weights multiplied in float32 (this CPU's bf16 matmul is the slower)"
        return "as the weights" if self.quantization == "none" else self.quantization
