"""The serving engine on a CUDA device, dry: real iterations with every device tensor fake.

There is no GPU here and torch is a CPU build, so the `fake_cuda` fixture stands in for one:
a tensor put on "cuda" is a torch FakeTensor (shape, dtype and device, no data) that runs
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

import ctypes
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.executor import KVSequence, ModelExecutor
from serving.linear import DenseLinear
from serving.model_runner import Norm
from serving.sampling_params import SamplingParams
from tests.fake_cuda import FakeDriver, FakeTensorGpu, installed
from vattn import ConfigurationError, KVCache, KVCacheConfig, UnavailableError
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel
from vattn.sizes import MiB

KERNELS = {"paged": "paged_gather", "virtual": "sdpa"}
"""Each cache kind's torch-SDPA kernel; `paged_gather` runs SDPA over a copy of each request's blocks."""
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

# c10's own fake CUDA device guard (FakeGuardImpl), registered while the tests run. Indexing a
# CUDA tensor (`t[i]`, `t[rows] = x`) takes a device guard in torch's Python bindings, even for
# a fake tensor, and a CPU-only build has none: "PyTorch is not linked with support for cuda
# devices". FakeTensorMode installs this guard itself (c10::impl::ensureCUDADeviceGuardSet) only
# for CUDA builds on machines without a GPU.
GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

// Installs (1) or removes (0) the guard; returns whether the registry changed.
extern "C" int fake_cuda_guard(int install) {
  static const c10::impl::DeviceGuardImplInterface* guard = new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>();
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  const c10::impl::DeviceGuardImplInterface* expected = install ? nullptr : guard;
  return slot.compare_exchange_strong(expected, install ? guard : nullptr);
}
"""


@pytest.fixture(scope="module")
def cuda_device_guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A CUDA device guard for this CPU-only torch while the module runs (compiled here, ~1 s)."""
    if torch.backends.cuda.is_built():
        yield  # with a GPU its real guard, without one FakeTensorMode's
        return
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("the fake CUDA device guard needs a C++ compiler (c++)")
    folder = tmp_path_factory.mktemp("fake_cuda_guard")
    source, library = folder / "guard.cpp", folder / "libfake_cuda_guard.so"
    source.write_text(GUARD_SOURCE)
    torch_lib = Path(torch.__file__).parent / "lib"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-isystem",
            str(Path(torch.__file__).parent / "include"),
            "-o",
            str(library),
            str(source),
            f"-L{torch_lib}",
            "-lc10",
            f"-Wl,-rpath,{torch_lib}",
        ],
        check=True,
        capture_output=True,
    )
    guard = ctypes.CDLL(str(library)).fake_cuda_guard
    installed = guard(1)  # else one is registered already
    yield
    if installed:
        assert guard(0)


def _is_cuda(leaf: Any) -> bool:
    """A fake tensor, a CUDA one, or a CUDA device."""
    if isinstance(leaf, Tensor):
        return isinstance(leaf, FakeTensor) or leaf.device.type == "cuda"
    return isinstance(leaf, torch.device) and leaf.type == "cuda"


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode for CUDA work only: an operator that reads a fake or CUDA tensor or names
    a CUDA device runs fake (real host tensors among its inputs are converted, so a CPU/CUDA mix
    raises a RuntimeError); every other one runs for real, so host tensors
    (the scheduler's tables, the sampler's logits) keep their values."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Sequence[type], args: Sequence[object] = (), kwargs: Any = None
    ) -> object:
        kwargs = kwargs or {}
        if any(_is_cuda(leaf) for leaf in pytree.tree_leaves((args, kwargs))):
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **kwargs)  # the mode is off while it dispatches: a real operator


@pytest.fixture
def fake_cuda(cuda_device_guard: None) -> FakeCudaMode:
    """A CUDA device that holds no data, while the test is `with` it."""
    return FakeCudaMode()


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
    driver = FakeDriver(granularity=2 * MiB, memory=4 << 30)
    with installed(driver, FakeTensorGpu(driver)):
        yield
    assert not driver.violations, driver.violations
    assert not driver.leaks(), driver.leaks()


def test_fake_device_keeps_host_tensors_and_refuses_a_mix(fake_cuda: FakeCudaMode) -> None:
    with fake_cuda:
        host = torch.arange(4)
        device = host.to(torch.device("cuda", 0))
        assert not isinstance(host, FakeTensor) and host.tolist() == [0, 1, 2, 3]
        assert isinstance(device, FakeTensor) and device.device.type == "cuda"
        assert (device[None] * 2)[0, 1:].shape == (3,)  # indexing takes the device guard
        with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
            _ = device + host


@pytest.mark.needs_model
def test_engine_iterations_on_cuda(fake_cuda: FakeCudaMode, cache_kind: str) -> None:
    with fake_cuda, cuda_memory(cache_kind):
        engine = DryRunEngine(engine_config(cache_kind))
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
