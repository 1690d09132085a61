"""GPU attention kernels on the virtual tensors: FlashAttention 2 and FlashInfer, unmodified.

FlashAttention 2 comes two ways: as torch itself ships it (`torch_flash_attn`: the varlen
entry point `aten::_flash_attention_forward`, in every CUDA build of torch, nothing to
install) and as the flash-attn package (`flash_attn`: `flash_attn_with_kvcache`; flash-attn-4's
`flash_attn.cute` has no KV-cache entry point).

Libraries are imported when a kernel is made, and a kernel refuses at construction what it
cannot run: a cache off the GPU, a dtype other than float16/bfloat16, a torch whose FA2 entry
point lacks an argument it needs, a library that is missing or cannot build its kernels
(FlashInfer compiles them on first use and needs nvcc for that: each FlashInfer kernel plans
and runs its variants once on scratch memory when made). Only an import or a build that fails
is `UnavailableError`; a fault while a built kernel runs is raised as it is, a failure, never
read as a skip. The paged baseline's GPU kernels use the same guards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from vattn.attention import AttentionBatch, AttentionKernel
from vattn.config import GPU_KERNEL_BLOCK_TOKENS
from vattn.errors import ConfigurationError, UnavailableError
from vattn.kv_cache import KVCache
from vattn.sizes import MiB
from vattn.torch_flash_attention import VARLEN_ARGUMENTS, TorchFlashAttention, token_rows

FLASHINFER_WORKSPACE_BYTES = 128 * MiB
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8)
"""Query heads per KV head that FlashInfer's CUDA-core decode is compiled for; others take the
tensor-core path."""


def require_gpu(device: torch.device, kernel: str) -> None:
    if device.type != "cuda":
        raise UnavailableError(f"the {kernel} kernel runs on a GPU; this cache is on {device} (backend='cuda')")


def require_half_precision(dtype: torch.dtype, kernel: str) -> None:
    if dtype not in (torch.float16, torch.bfloat16):
        raise ConfigurationError(
            f"the {kernel} kernel runs float16 or bfloat16 caches, not {dtype}: use dtype='bfloat16' "
            "(vattn serve --dtype bfloat16) or the sdpa kernel"
        )


def import_flash_attn(kernel: str) -> Callable[..., Tensor]:
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise UnavailableError(
            f"the {kernel} kernel needs FlashAttention 2 (pip install flash-attn; flash-attn-4's "
            f"flash_attn.cute has no flash_attn_with_kvcache): {exc}"
        ) from exc
    return flash_attn_with_kvcache


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA error raised by work on the device (an illegal address, a launch failure), as
    opposed to a library or kernel build that failed before anything ran."""
    return isinstance(exc, torch.AcceleratorError) or "CUDA error" in str(exc)


@contextmanager
def flashinfer_available(kernel: str) -> Iterator[None]:
    """Turns a FlashInfer import or kernel build that fails (no nvcc, no cached cubins, a
    library that cannot load) into UnavailableError with the library's reason; a device
    fault is raised as it is."""
    try:
        yield
    except (ImportError, RuntimeError, OSError) as exc:
        if is_device_fault(exc):
            raise
        raise UnavailableError(f"the {kernel} kernel cannot load FlashInfer's kernels here: {exc}") from exc


def import_flashinfer(kernel: str) -> Any:
    with flashinfer_available(kernel):
        import flashinfer
    return flashinfer


def decode_uses_tensor_cores(num_query_heads: int, num_kv_heads: int) -> bool:
    return num_query_heads // num_kv_heads not in CUDA_CORE_DECODE_GROUPS


@dataclass(frozen=True)
class PlannedWrapper:
    """A FlashInfer wrapper as one plan() left it. The wrapper's plan lives in its workspace,
    which the next plan() overwrites, so a batch planned before the latest is refused."""

    wrapper: Any
    generation: int


@dataclass(frozen=True)
class PagedShape:
    """What FlashInfer's plans fix for a kernel: its heads, head size, tokens per page, dtype and scale."""

    query_heads: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype
    scale: float


class FlashInferPlans:
    """One kernel's FlashInfer decode and prefill wrappers over a zeroed workspace (FlashInfer
    asks for zeros before first use), the one planner of both kernels that read pages through
    them (the virtual tensors' and the paged cache's), and the count of plans made, so stale
    batches are caught."""

    def __init__(self, flashinfer: Any, device: torch.device, shape: PagedShape) -> None:
        workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        tensor_cores = decode_uses_tensor_cores(shape.query_heads, shape.kv_heads)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.device, self.shape = device, shape
        self._generations = itertools.count(1)
        self.latest = 0

    def plan(
        self, starts: Sequence[int], indptr: list[int], indices: list[int], last: list[int], decode: bool
    ) -> PlannedWrapper:
        """Plans one iteration: query rows from `starts`, pages from FlashInfer's (indptr,
        indices, last_page_len); a decode-only iteration on the decode wrapper."""

        def on_device(values: Sequence[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        shape = self.shape
        heads = (shape.query_heads, shape.kv_heads, shape.head_dim, shape.block_tokens)
        tables = (on_device(indptr), on_device(indices), on_device(last))
        options = {"q_data_type": shape.dtype, "sm_scale": shape.scale}
        if decode:
            self.decode.plan(*tables, *heads, **options)
            return self._planned(self.decode)
        self.prefill.plan(on_device(starts), *tables, *heads, causal=True, **options)
        return self._planned(self.prefill)

    def _planned(self, wrapper: Any) -> PlannedWrapper:
        self.latest = next(self._generations)
        return PlannedWrapper(wrapper, self.latest)

    def run(self, planned: PlannedWrapper, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        if planned.generation != self.latest:
            raise RuntimeError(
                "this batch was planned before the kernel's latest plan(), which replaced its FlashInfer "
                "plan: plan each iteration just before running it"
            )
        return planned.wrapper.run(q, kv)


def token_blocks(keys: Tensor, block_tokens: int) -> tuple[Tensor, int]:
    """A `[slots, context, heads, dim]` virtual tensor seen as blocks of `block_tokens` tokens
    (no copy; FlashInfer's paged wrappers call them pages): `[blocks, block_tokens, heads, dim]`
    where slot s's k-th block is block `s * blocks_per_slot + k`. Returns the view and
    `blocks_per_slot`. ValueError when the slot stride is not a whole number of blocks, or
    FlashInfer's 32-bit stride cannot hold a block's."""
    slot_stride, token_stride, head_stride, _ = keys.stride()
    block_stride = block_tokens * token_stride
    if keys.shape[1] % block_tokens:
        raise ValueError(
            f"a slot of {keys.shape[1]} tokens is not a whole number of {block_tokens}-token pages: "
            f"use a max_context that is a multiple of {block_tokens}"
        )
    if slot_stride % block_stride:
        raise ValueError(
            f"the slot stride ({slot_stride} elements) is not a whole number of {block_tokens}-token pages "
            f"({block_stride} elements): KVCacheConfig rounds it to them, so this tensor was not laid out by one"
        )
    if block_stride >= 2**32:
        raise ValueError(
            f"FlashInfer's page stride is 32-bit, and a {block_tokens}-token page spans {block_stride} elements: "
            "use layout='per_layer' or fewer kv heads per cache"
        )
    blocks_per_slot = slot_stride // block_stride
    blocks = keys.as_strided(
        (keys.shape[0] * blocks_per_slot, block_tokens, keys.shape[2], keys.shape[3]),
        (block_stride, token_stride, head_stride, 1),
    )
    return blocks, blocks_per_slot


def block_table(
    reqids: tuple[int, ...], lengths: tuple[int, ...], blocks_per_slot: int, block_tokens: int
) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's (indptr, indices, last_page_len) for requests reading their slots' first blocks."""
    indptr, indices, last = [0], [], []
    for reqid, length in zip(reqids, lengths, strict=True):
        count = -(-length // block_tokens)
        indices += range(reqid * blocks_per_slot, reqid * blocks_per_slot + count)
        indptr.append(len(indices))
        last.append(length - (count - 1) * block_tokens)
    return indptr, indices, last


class FlashAttnKernel(AttentionKernel):
    """FlashAttention's `flash_attn_with_kvcache`: `cache_batch_idx` = slots, `cache_seqlens` =
    cached lengths, new K/V appended in place by the kernel. Decode batches run in one call,
    prefill chunks one request per call."""

    name = "flash_attn"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        self._attend = import_flash_attn(self.name)

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = kv
        if batch.is_decode:
            out = self._attend(
                q.unsqueeze(1),
                keys,
                values,
                k=k.unsqueeze(1),
                v=v.unsqueeze(1),
                cache_seqlens=batch.cached_lengths,
                cache_batch_idx=batch.device_reqids,
                softmax_scale=self.scale,
                causal=True,
            )
            return out.squeeze(1)
        out = torch.empty_like(q)
        for request in batch.requests():
            rows, one = request.rows, slice(request.index, request.index + 1)
            out[rows] = self._attend(
                q[rows].unsqueeze(0),
                keys,
                values,
                k=k[rows].unsqueeze(0),
                v=v[rows].unsqueeze(0),
                cache_seqlens=batch.cached_lengths[one],
                cache_batch_idx=batch.device_reqids[one],
                softmax_scale=self.scale,
                causal=True,
            ).squeeze(0)
        return out


class TorchFlashAttnKernel(AttentionKernel):
    """torch's own FlashAttention 2 (`TorchFlashAttention`) on the virtual tensors: a layer's K
    and V seen as one column of token rows (a strided view, no copy), request i's keys the
    `length` rows from its slot's first, `reqid * rows_per_slot`. No block table: the paper's
    claim, an unmodified kernel reading virtually contiguous KV."""

    name = "torch_flash_attn"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        self._attend = TorchFlashAttention(self.name, cache.device, cache.config.head_dim, VARLEN_ARGUMENTS)
        keys, _ = cache.layer_tensors(0)
        self._rows_per_slot = token_rows(keys)[1]  # refuses a layout it cannot address
        del keys

    def _planned(self, batch: AttentionBatch) -> AttentionBatch:
        key_starts = [reqid * self._rows_per_slot for reqid in batch.reqids]
        key_starts.append(self.cache.config.max_slots * self._rows_per_slot)  # read by no request: seqused_k
        plan = self._attend.plan(batch.starts, key_starts, batch.lengths, batch.new_tokens)
        return replace(batch, wrapper=plan)

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        keys, values = (token_rows(tensor)[0] for tensor in kv)
        return self._attend(batch.wrapper, q, keys, values, self.scale)


class FlashInferSingleKernel(AttentionKernel):
    """FlashInfer's `single_prefill_with_kv_cache` / `single_decode_with_kv_cache` on each
    request's `[length, kv_heads, dim]` slice (contiguous in the per-layer layout)."""

    name = "flashinfer_single"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        if cache.config.layout != "per_layer":
            raise ValueError("flashinfer_single needs each slot's K/V contiguous: use layout='per_layer'")
        self._flashinfer = import_flashinfer(self.name)
        self._tensor_cores = decode_uses_tensor_cores(num_query_heads, cache.config.num_kv_heads)
        cfg = cache.config
        with flashinfer_available(self.name):  # builds (or loads) and runs both variants now
            scratch = torch.zeros(4, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=cache.device)
            query = torch.zeros(4, num_query_heads, cfg.head_dim, dtype=cfg.dtype, device=cache.device)
            self._attend(query, scratch, scratch)
            self._attend(query[:1], scratch, scratch)

    def _attend(self, q: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if q.shape[0] == 1:
            return self._flashinfer.single_decode_with_kv_cache(
                q[0], key, value, kv_layout="NHD", sm_scale=self.scale, use_tensor_cores=self._tensor_cores
            ).unsqueeze(0)
        return self._flashinfer.single_prefill_with_kv_cache(
            q, key, value, causal=True, kv_layout="NHD", sm_scale=self.scale
        )

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        keys, values = kv
        out = torch.empty_like(q)
        for request in batch.requests():
            reqid, rows, length = request.reqid, request.rows, request.length
            out[rows] = self._attend(q[rows], keys[reqid, :length], values[reqid, :length])
        return out


class FlashInferPagedKernel(AttentionKernel):
    """FlashInfer's paged wrappers reading the virtual tensors as a paged cache: each slot is
    `GPU_KERNEL_BLOCK_TOKENS`-token pages (a strided view, no copy), a request's pages its
    slot's first ones. One planned call per layer for the whole batch, decode or mixed. Pages
    of 16 rather than one per slot: FlashInfer's decode scheduler splits a request's KV only at
    page boundaries, and one page per slot would leave one thread block per (request, head)."""

    name = "flashinfer_paged"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        flashinfer = import_flashinfer(self.name)  # first: a refusal's traceback then holds no view of the cache
        keys, _ = cache.layer_tensors(0)
        _, self._blocks_per_slot = token_blocks(keys, GPU_KERNEL_BLOCK_TOKENS)  # refuses a layout it cannot page
        del keys
        cfg = cache.config
        shape = PagedShape(
            num_query_heads, cfg.num_kv_heads, cfg.head_dim, GPU_KERNEL_BLOCK_TOKENS, cfg.dtype, self.scale
        )
        with flashinfer_available(self.name):
            self._plans = FlashInferPlans(flashinfer, cache.device, shape)
        self._warm_up()

    def _warm_up(self) -> None:
        """Plans a decode and a prefill over a scratch page (building or loading their kernels:
        a failure there means unavailable), then runs them (a failure there is a fault)."""
        cfg, device = self.cache.config, self.cache.device
        page = torch.zeros(1, GPU_KERNEL_BLOCK_TOKENS, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=device)
        for rows in (1, 2):
            q = torch.zeros(rows, self.num_query_heads, cfg.head_dim, dtype=cfg.dtype, device=device)
            with flashinfer_available(self.name):
                planned = self._plans.plan((0, rows), [0, 1], [0], [2], decode=rows == 1)
            self._plans.run(planned, q, (page, page))

    def _planned(self, batch: AttentionBatch) -> AttentionBatch:
        tables = block_table(batch.reqids, batch.lengths, self._blocks_per_slot, GPU_KERNEL_BLOCK_TOKENS)
        return replace(batch, wrapper=self._plans.plan(batch.starts, *tables, decode=batch.is_decode))

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        pages = tuple(token_blocks(tensor, GPU_KERNEL_BLOCK_TOKENS)[0] for tensor in kv)
        return self._plans.run(batch.wrapper, q, pages)  # type: ignore[arg-type]
