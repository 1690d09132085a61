"""The serving engine on a CUDA device, dry: real iterations with every device tensor fake.

There is no GPU here and torch is a CPU build, so the `fake_cuda` fixture (tests/fake_gpu.py)
stands in for one: a tensor put on "cuda" is a torch FakeTensor (shape, dtype and device, no data) that runs
every operator's shape and device logic, and raises a device-mismatch RuntimeError where it
meets a CPU tensor, as a GPU would; host tensors stay real. The engine is built on its real
path (`LLMEngine(EngineConfig(backend="cuda", ...))`: model loaded on the CPU, moved to the
KV cache's device) and runs real iterations: prefills, a chunked prefill and decodes of
several requests, through the embedding, fused projections, rotary, norms, the KV writes
into the cache, the attention kernel and the LM head, all on fake CUDA tensors.

The fake data enters at one place: `ModelExecutor._to_host`, the iteration's one device-to-host
copy (the logits the sampler reads). `DryRunExecutor` overrides it: it checks the tensor it
gets (fake, on cuda, float32, one row per wanted position) and returns deterministic host
logits of that shape instead, which the real sampler reads. Any other read of device values
(`.item()`, `.tolist()`) would raise DataDependentOutputException, so a passing run also
shows the engine reads nothing else back from the device.

Both caches run: the paged baseline, and vattn's virtual KVCache on the CUDA backend over
tests/fake_cuda's driver (an H100's 2 MiB granularity, checked for leaks after), whose torch
side hands out data-less CUDA tensors over the addresses it maps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.executor import KVSequence, ModelExecutor
from serving.model.linear import DenseLinear
from serving.model.runner import Norm
from serving.sampling_params import SamplingParams
from tests.fake_gpu import FakeCudaMode, device_guard, fake_cuda_memory
from vattn import ConfigurationError, KVCache, KVCacheConfig, UnavailableError
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel
from vattn.sizes import MiB

KERNELS = {"paged": "paged_gather", "virtual": "sdpa"}
"""Each cache kind's torch-SDPA kernel; `paged_gather` runs SDPA over a copy of each request's blocks."""
FLASH_KERNELS = {"paged": "paged_torch_flash_attn", "virtual": "torch_flash_attn"}
"""Each cache kind's FlashAttention 2 from torch (blocks of 256 on the paged cache)."""
KV_BUDGETS = {"paged": 32 * MiB, "virtual": 512 * MiB}
"""The virtual cache's first page group maps a 2 MiB page for each of 60 tensors (30 layers' K and V)."""

DEVICE_MISMATCH = "devices"
"""In the message of FakeTensorMode's device-mismatch RuntimeError (torch 2.12 named its class
FakeTensorDeviceMismatchError; older torch raises a plain RuntimeError)."""
MAX_BATCHED_TOKENS = 32
PROMPTS = {
    "short": "The capital of France is",
    "long": "Here is a long story about a lighthouse keeper who lived alone on a rocky island far from the "
    "coast. Every night he climbed the stairs, lit the lamp and watched the ships go by.",
    "medium": "def fibonacci(n):",
}
"""Three requests at once; the long one's prompt is longer than an iteration's token budget."""
MAX_TOKENS = 6
TOKEN_TEXT = " ok"
"""What the substituted logits always choose."""


@pytest.fixture
def fake_cuda() -> Iterator[FakeCudaMode]:
    """A CUDA device that holds no data, while the test is `with` it (tests/fake_gpu.py)."""
    with device_guard():
        yield FakeCudaMode()


def engine_config(cache: str, **overrides: Any) -> EngineConfig:
    """The engine under test: the default model in bf16 on CUDA, the `cache` KV cache and its
    SDPA kernel, an iteration budget the long prompt exceeds."""
    fields_: dict[str, Any] = {
        "kv_cache": cache,
        "backend": "cuda",
        "kernel": KERNELS[cache],
        "dtype": "bfloat16",
        "max_slots": 4,
        "max_context": 256,
        "max_batched_tokens": MAX_BATCHED_TOKENS,
        "reserve_tokens": MAX_TOKENS,
        "kv_budget": KV_BUDGETS[cache],
    }
    return EngineConfig(**{**fields_, **overrides})


class DryRunExecutor(ModelExecutor):
    """The executor as it is, but for `_to_host` (see the module docstring); it records what each
    iteration computed: per sequence, (tokens computed before, new tokens, prompt length)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.batches: list[list[tuple[int, int, int]]] = []
        self.token = 0
        """What the substituted logits choose (set by the engine, which has the tokenizer)."""
        self._rows = 0

    def compute(self, sequences: Sequence[KVSequence], new_tokens: Sequence[int], rows: Sequence[int]) -> Tensor:
        self.batches.append(
            [(s.num_computed, n, len(s.prompt_ids)) for s, n in zip(sequences, new_tokens, strict=True)]  # type: ignore[attr-defined]
        )
        self._rows = sum(rows)
        return super().compute(sequences, new_tokens, rows)

    def _to_host(self, logits: Tensor) -> Tensor:
        assert isinstance(logits, FakeTensor), type(logits)
        assert logits.device.type == "cuda", logits.device
        assert logits.dtype == torch.float32
        assert tuple(logits.shape) == (self._rows, self.vocab_size)
        host = torch.full(tuple(logits.shape), -1.0)
        host[:, self.token] = 1.0
        return host


class DryRunEngine(LLMEngine):
    """The engine as it is, on the dry-run executor."""

    executor_type = DryRunExecutor
    executor: DryRunExecutor

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.token = self.executor.token = self.tokenizer.encode(TOKEN_TEXT, add_special_tokens=False)[0]

    @property
    def iterations(self) -> list[list[tuple[int, int, int]]]:
        return self.executor.batches


def device_tensors(engine: LLMEngine) -> dict[str, Tensor]:
    """Every tensor the model runner computes with, by name."""
    runner = engine.executor.runner
    found = dict(runner._body.named_parameters()) | dict(runner._body.named_buffers())
    found |= {"final_norm": runner._final_norm.weight, "lm_head": runner._lm_head.weight}  # type: ignore[attr-defined]
    for index, layer in enumerate(runner._layers):
        for field in fields(layer):
            part = getattr(layer, field.name)
            assert isinstance(part, Norm | DenseLinear), f"layer {index}.{field.name} is a {type(part).__name__}"
            found[f"layers.{index}.{field.name}"] = part.weight
            if isinstance(part, DenseLinear) and part.bias is not None:
                found[f"layers.{index}.{field.name}.bias"] = part.bias
    return found


@pytest.fixture(params=["paged", "virtual"])
def cache_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@contextmanager
def cuda_memory(cache: str) -> Iterator[None]:
    """For the virtual cache, the fake CUDA driver with an H100's granularity; nothing may leak."""
    if cache != "virtual":
        yield
        return
    with fake_cuda_memory(4 << 30):
        yield


def test_fake_device_keeps_host_tensors_and_refuses_a_mix(fake_cuda: FakeCudaMode) -> None:
    with fake_cuda:
        host = torch.arange(4)
        device = host.to(torch.device("cuda", 0))
        assert not isinstance(host, FakeTensor) and host.tolist() == [0, 1, 2, 3]
        assert isinstance(device, FakeTensor) and device.device.type == "cuda"
        assert (device[None] * 2)[0, 1:].shape == (3,)  # indexing takes the device guard
        with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
            _ = device + host


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(None, marks=pytest.mark.needs_model, id="default-model"),
        pytest.param("synthetic:paper", id="synthetic-paper"),  # 8 KV heads of 128, GQA: nothing to download
    ],
)
@pytest.mark.parametrize("kernels", ["sdpa", "torch_flash_attn"])
def test_engine_iterations_on_cuda(
    fake_cuda: FakeCudaMode, cache_kind: str, kernels: str, model: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torch's FlashAttention 2 as what a CUDA build of torch says of itself on an sm90 GPU."""
    overrides: dict[str, Any] = {"model": model}
    if kernels == "torch_flash_attn":
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        overrides |= {"kernel": FLASH_KERNELS[cache_kind], "block_size": 256}
    with fake_cuda, cuda_memory(cache_kind):
        engine = DryRunEngine(engine_config(cache_kind, **overrides))
        try:
            assert engine.kv.device.type == "cuda"
            for name, tensor in device_tensors(engine).items():
                assert tensor.device == engine.kv.device, name
                expected = torch.float32 if name.endswith("inv_freq") else torch.bfloat16
                assert tensor.dtype == expected, f"{name}: {tensor.dtype}"  # rotary tables keep their precision
            store: Any = engine.kv
            layer_kv = store._kernel._layer_kv(0) if cache_kind == "paged" else store.cache.layer_tensors(0)
            assert all(t.device.type == "cuda" for t in layer_kv)

            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            prompt_ids = {name: engine.encode(prompt)[1] for name, prompt in PROMPTS.items()}
            assert len(prompt_ids["long"]) > MAX_BATCHED_TOKENS
            ids = {name: engine.add_request(prompt, params) for name, prompt in PROMPTS.items()}
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
                assert steps < 50
            outputs = {name: engine.result(request_id) for name, request_id in ids.items()}
        finally:
            engine.close()

    for output in outputs.values():
        assert output.finish_reason == "length" and output.error is None
        assert output.token_ids == [engine.token] * MAX_TOKENS
        assert output.text == engine.tokenizer.decode([engine.token] * MAX_TOKENS)
    assert engine.stats().iterations == len(engine.iterations) == steps
    computed = [entry for iteration in engine.iterations for entry in iteration]
    long_prompt = len(prompt_ids["long"])
    assert (0, long_prompt, long_prompt) not in computed  # never in one iteration:
    assert any(start == 0 and 1 < new < prompt for start, new, prompt in computed)  # a first chunk
    assert any(0 < start < prompt and new > 1 for start, new, prompt in computed)  # a later chunk
    assert any(start == 0 and new == prompt > 1 for start, new, prompt in computed)  # a whole prefill
    assert any(  # continuous batching: a decode beside prompt work
        any(start >= prompt for start, _, prompt in it) and any(start < prompt for start, _, prompt in it)
        for it in engine.iterations
    )
    decodes = [it for it in engine.iterations if all(start >= prompt for start, _, prompt in it)]
    assert any(len(iteration) == len(PROMPTS) for iteration in decodes)  # all three decoding together
    assert sum(new for start, new, prompt in computed if start >= prompt) == len(PROMPTS) * (MAX_TOKENS - 1)


@pytest.mark.needs_model
def test_int8_weights_are_refused_on_cuda(fake_cuda: FakeCudaMode, cache_kind: str) -> None:
    with fake_cuda, cuda_memory(cache_kind), pytest.raises(UnavailableError, match="int8 quantization runs on the CPU"):
        LLMEngine(replace(engine_config(cache_kind), quantization="int8"))


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer_single", "flashinfer_paged"])
def test_gpu_kernels_refuse_a_precision_they_cannot_run_when_made(fake_cuda: FakeCudaMode, name: str) -> None:
    """On a CUDA cache: float32 is refused with the fix; bfloat16 gets as far as the library,
    which is missing here and reported as unavailable."""
    with fake_cuda, cuda_memory("virtual"):
        for dtype, error, message in [
            ("float32", ConfigurationError, "runs float16 or bfloat16 caches, not torch.float32: use dtype="),
            ("bfloat16", UnavailableError, "needs|cannot load"),
        ]:
            config = KVCacheConfig(2, 2, 64, 2, 256, dtype=dtype, backend="cuda", page_size=2 * MiB)
            with KVCache(config) as cache, pytest.raises(error, match=message):
                make_kernel(name, cache, 8)


@pytest.mark.parametrize("name", ["paged_flash_attn", "paged_flashinfer"])
def test_paged_gpu_kernels_refuse_a_precision_they_cannot_run_when_made(fake_cuda: FakeCudaMode, name: str) -> None:
    with fake_cuda:
        config = PagedKVCacheConfig(2, 2, 64, 2, 512, dtype="float32", block_size=256, device="cuda")
        with pytest.raises(ConfigurationError, match="runs float16 or bfloat16 caches"):
            make_paged_kernel(name, PagedKVCache(config), 8)
