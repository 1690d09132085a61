"""Attention kernels over the paged cache's block table, selectable by name.

The same contract as `vattn.kernels`: one iteration's new tokens packed ragged, `[tokens,
heads, head_dim]`; a kernel stores their K/V into the request's blocks and returns their
attention output. What differs is what a kernel must do to find a request's KV:

- `paged` (CPU): vattn's ragged kernel reading rows through the block table
  (`torch.ops.vattn.paged_attention`, the same code as the virtual cache's `ragged` with
  only the row address changed), decodes and prefill chunks in one call per layer. The
  fastest paged path here: paper_repro's decode experiment measures it against the two
  below.
- `paged_gather` (CPU or GPU): copies each request's blocks into one contiguous tensor
  and runs torch SDPA on it; the simplest correct paged path.
- `paged_blockwise` (CPU or GPU): decodes attended block by block with an online-softmax
  merge in torch operators, all requests at once (~10 operators per block per layer).
- `paged_torch_flash_attn` (GPU): torch's own FlashAttention 2 varlen forward with its
  `block_table` (block size a multiple of 256, as FA2 requires): the same call as the
  virtual cache's `torch_flash_attn`, which finds a request's keys by its slot's first row.
- `paged_flash_attn` (GPU): flash-attn's `block_table` path (block size a multiple of 256).
- `paged_flashinfer` (GPU): FlashInfer's paged prefill/decode wrappers, one planned call
  per layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from vattn.attention import AttentionKernel, Batch, iteration_rows, sdpa_request
from vattn.errors import UnavailableError
from vattn.gpu_kernels import (
    FlashInferPlans,
    PagedShape,
    flashinfer_available,
    import_flash_attn,
    import_flashinfer,
    require_gpu,
    require_half_precision,
)
from vattn.ops import vattn_ops
from vattn.paged.paged_cache import PagedKVCache
from vattn.torch_flash_attention import PAGED_ARGUMENTS, TorchFlashAttention


@dataclass(frozen=True, kw_only=True)
class PagedBatch(Batch):
    """A batch on the paged cache: request i's KV in the blocks of its row of the block table."""

    token_rows: Tensor
    """int64 `[tokens]`: row of each new token in a layer's blocks flattened to `[blocks * block_size]`."""
    block_table: Tensor
    """int32 `[batch, max_blocks]` on the cache's device: each request's blocks in order."""
    host_block_table: Tensor
    """The same on the host."""


class PagedKernel(AttentionKernel):
    """An attention implementation bound to one paged cache and one model's query head count;
    `forward` (with its checks) is AttentionKernel's, over the layer's blocks."""

    cache: PagedKVCache  # type: ignore[assignment]

    def plan(self, reqids: Sequence[int], new_tokens: Sequence[int]) -> PagedBatch:
        """Checks the iteration against the cache's lengths and builds its index tensors."""
        if not reqids or len(reqids) != len(new_tokens) or len(set(reqids)) != len(reqids):
            raise ValueError(f"plan needs distinct reqids and one new-token count each, got {reqids}, {new_tokens}")
        lengths = self.cache.lengths(reqids)
        new_tokens, starts = iteration_rows(reqids, new_tokens, lengths)
        size, device = self.cache.config.block_size, self.cache.device
        used = max(self.cache.config.blocks_for(n) for n in lengths)
        host_table = self.cache.block_table[list(reqids), :used].clone()
        positions = torch.tensor(
            [p for new, n in zip(new_tokens, lengths, strict=True) for p in range(n - new, n)], dtype=torch.int64
        )
        owners = torch.repeat_interleave(torch.arange(len(new_tokens)), torch.tensor(new_tokens))
        rows = host_table[owners, positions // size].long() * size + positions % size
        batch = PagedBatch(
            reqids=tuple(reqids),
            new_tokens=tuple(new_tokens),
            lengths=tuple(lengths),
            starts=tuple(starts),
            token_positions=positions.to(device),
            token_rows=rows.to(device),
            block_table=host_table.to(device),
            host_block_table=host_table,
        )
        return self._planned(batch)

    def _layer_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.cache.layer_blocks(layer)

    @staticmethod
    def _store(blocks: tuple[Tensor, Tensor], batch: PagedBatch, k: Tensor, v: Tensor) -> None:
        """Writes the new tokens' K/V into their blocks in one indexed copy per tensor."""
        for part, new in zip(blocks, (k, v), strict=True):
            part.flatten(0, 1).index_copy_(0, batch.token_rows, new)

    def _gathered_sdpa(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, i: int, q: Tensor) -> Tensor:
        """Request i's attention by SDPA over a contiguous copy of its blocks."""
        length = batch.lengths[i]
        table = batch.block_table[i, : self.cache.config.blocks_for(length)].long()
        keys, values = (part[table].flatten(0, 1)[:length] for part in blocks)
        return sdpa_request(q, keys, values, length, self.scale)


class PagedGatherKernel(PagedKernel):
    name = "paged_gather"

    def _forward(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(blocks, batch, k, v)
        out = torch.empty_like(q)
        for request in batch.requests():
            out[request.rows] = self._gathered_sdpa(blocks, batch, request.index, q[request.rows])
        return out


class PagedBlockwiseKernel(PagedKernel):
    """Decodes attended block by block in torch, all requests at once, merged with an online
    softmax (the block-table loop a paged kernel runs, written with torch operators); chunks
    of more than one token are gathered for SDPA."""

    name = "paged_blockwise"

    def _forward(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(blocks, batch, k, v)
        out = torch.empty_like(q)
        decodes = [i for i, new in enumerate(batch.new_tokens) if new == 1]
        if decodes:
            rows = torch.tensor([batch.starts[i] for i in decodes], device=q.device)
            out[rows] = self._blockwise(blocks, batch, decodes, q[rows])
        for request in batch.requests():
            if request.new_tokens > 1:
                out[request.rows] = self._gathered_sdpa(blocks, batch, request.index, q[request.rows])
        return out

    def _blockwise(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, requests: list[int], q: Tensor) -> Tensor:
        """Attention of one query row per request `[requests, heads, dim]` over their blocks."""
        cfg = self.cache.config
        count, heads, dim = q.shape
        size, kv_heads = cfg.block_size, cfg.num_kv_heads
        table = batch.block_table[requests].long()
        lengths = torch.tensor([batch.lengths[i] for i in requests], device=q.device)
        query = q.view(count, kv_heads, heads // kv_heads, dim).float() * self.scale
        top = torch.full(query.shape[:-1], float("-inf"), device=q.device)
        total = torch.zeros_like(top)
        acc = torch.zeros_like(query)
        offsets = torch.arange(size, device=q.device)
        for j in range(cfg.blocks_for(max(batch.lengths[i] for i in requests))):
            keys, values = (part[table[:, j]].float() for part in blocks)  # [requests, size, kv_heads, dim]
            scores = torch.einsum("bhgd,bthd->bhgt", query, keys)
            seen = (j * size + offsets)[None] < lengths[:, None]  # every request sees block 0's first key
            scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
            new_top = torch.maximum(top, scores.amax(-1))
            kept = torch.exp(top - new_top)
            weights = torch.exp(scores - new_top[..., None])
            total = total * kept + weights.sum(-1)
            values = values.masked_fill(~seen[..., None, None], 0)  # 0 x a stale NaN would be NaN
            acc = acc * kept[..., None] + torch.einsum("bhgt,bthd->bhgd", weights, values)
            top = new_top
        return (acc / total[..., None]).view(count, heads, dim).to(q.dtype)


class PagedNativeKernel(PagedKernel):
    name = "paged"
    reads_int8_cache = True

    def __init__(self, cache: PagedKVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        if cache.device.type != "cpu":
            raise UnavailableError(f"the paged kernel runs on the CPU; this cache is on {cache.device}")
        self._attend = vattn_ops().paged_attention

    def _planned(self, batch: PagedBatch) -> PagedBatch:
        """As the ragged kernel's vectors, with the requests' block table rows for reqids."""
        columns = (batch.starts[:-1], batch.new_tokens, batch.lengths)
        vectors = tuple(torch.tensor(column, dtype=torch.int64) for column in columns)
        return replace(batch, wrapper=(batch.host_block_table.contiguous(), *vectors))

    def _layer_kv(self, layer: int) -> tuple[Tensor, ...]:
        """K and V blocks, and an int8 cache's K and V qparams after them."""
        blocks = self.cache.layer_blocks(layer)
        return (*blocks, *self.cache.layer_qparams(layer)) if self.cache.config.quantized else blocks

    def _forward(self, blocks: tuple[Tensor, ...], batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        keys, values, *qparams = blocks
        self._attend(out, q, keys, values, *batch.wrapper, self.scale, k, v, *qparams)  # stores k, v, then attends
        return out


def require_flash_attention_blocks(block_size: int, kernel: str) -> None:
    if block_size % 256:
        raise ValueError(f"FlashAttention 2's paged path ({kernel}) needs block_size % 256 == 0, got {block_size}")


class PagedTorchFlashAttnKernel(PagedKernel):
    """torch's own FlashAttention 2 (`TorchFlashAttention`) over the block table: one call per
    layer for decodes and prefill chunks together, as the virtual cache's `torch_flash_attn`."""

    name = "paged_torch_flash_attn"

    def __init__(self, cache: PagedKVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        require_flash_attention_blocks(cache.config.block_size, self.name)
        self._attend = TorchFlashAttention(self.name, cache.device, cache.config.head_dim, PAGED_ARGUMENTS)

    def _planned(self, batch: PagedBatch) -> PagedBatch:
        key_starts = [0, *itertools.accumulate(batch.lengths)]
        plan = self._attend.plan(batch.starts, key_starts, batch.lengths, batch.new_tokens, batch.block_table)
        return replace(batch, wrapper=plan)

    def _forward(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(blocks, batch, k, v)
        return self._attend(batch.wrapper, q, *blocks, self.scale)


class PagedFlashAttnKernel(PagedKernel):
    """FlashAttention's `flash_attn_with_kvcache` with `block_table`; new K/V appended by the
    kernel. Decode batches in one call, prefill chunks one request per call."""

    name = "paged_flash_attn"

    def __init__(self, cache: PagedKVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        require_flash_attention_blocks(cache.config.block_size, self.name)
        self._attend = import_flash_attn(self.name)

    def _forward(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cached = torch.tensor(
            [n - new for n, new in zip(batch.lengths, batch.new_tokens, strict=True)],
            dtype=torch.int32,
            device=q.device,
        )
        if batch.is_decode:
            return self._call(blocks, q, k, v, cached, batch.block_table).squeeze(1)
        out = torch.empty_like(q)
        for request in batch.requests():
            rows, one = request.rows, slice(request.index, request.index + 1)
            out[rows] = self._call(
                blocks, q[rows][None], k[rows][None], v[rows][None], cached[one], batch.block_table[one]
            )[0]
        return out

    def _call(
        self, blocks: tuple[Tensor, Tensor], q: Tensor, k: Tensor, v: Tensor, cached: Tensor, table: Tensor
    ) -> Tensor:
        if q.dim() == 3:  # a decode batch: one new token per request
            q, k, v = q[:, None], k[:, None], v[:, None]
        return self._attend(
            q, *blocks, k=k, v=v, cache_seqlens=cached, block_table=table, softmax_scale=self.scale, causal=True
        )


class PagedFlashInferKernel(PagedKernel):
    """FlashInfer's paged wrappers over the block table (`indptr`/`indices`/`last_page_len`)."""

    name = "paged_flashinfer"

    def __init__(self, cache: PagedKVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        require_half_precision(cache.config.dtype, self.name)
        flashinfer = import_flashinfer(self.name)
        cfg = cache.config
        shape = PagedShape(num_query_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size, cfg.dtype, self.scale)
        with flashinfer_available(self.name):
            self._plans = FlashInferPlans(flashinfer, cache.device, shape)
        self._warm_up()

    def _warm_up(self) -> None:
        """Plans a decode and a prefill over the first block (building or loading their kernels:
        a failure there means unavailable), then runs them (a failure there is a fault)."""
        cfg, device = self.cache.config, self.cache.device
        blocks = tuple(part[:1] for part in self._layer_kv(0))
        for rows in (1, 2):
            q = torch.zeros(rows, self.num_query_heads, cfg.head_dim, dtype=cfg.dtype, device=device)
            with flashinfer_available(self.name):
                planned = self._plans.plan((0, rows), [0, 1], [0], [2], decode=rows == 1)
            self._plans.run(planned, q, blocks)  # type: ignore[arg-type]

    def _planned(self, batch: PagedBatch) -> PagedBatch:
        cfg = self.cache.config
        counts = [cfg.blocks_for(n) for n in batch.lengths]
        table = batch.host_block_table
        indices = [block for i, count in enumerate(counts) for block in table[i, :count].tolist()]
        indptr = [0, *itertools.accumulate(counts)]
        last = [n - (c - 1) * cfg.block_size for n, c in zip(batch.lengths, counts, strict=True)]
        return replace(batch, wrapper=self._plans.plan(batch.starts, indptr, indices, last, decode=batch.is_decode))

    def _forward(self, blocks: tuple[Tensor, Tensor], batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(blocks, batch, k, v)
        return self._plans.run(batch.wrapper, q, blocks)


PAGED_KERNELS: dict[str, type[PagedKernel]] = {
    kernel.name: kernel
    for kernel in (
        PagedNativeKernel,
        PagedGatherKernel,
        PagedBlockwiseKernel,
        PagedTorchFlashAttnKernel,
        PagedFlashAttnKernel,
        PagedFlashInferKernel,
    )
}


def make_paged_kernel(name: str, cache: PagedKVCache, num_query_heads: int) -> PagedKernel:
    """The paged kernel called `name` (see PAGED_KERNELS); UnavailableError if it cannot run here."""
    if name not in PAGED_KERNELS:
        raise ValueError(f"unknown paged attention kernel {name!r}; available: {', '.join(PAGED_KERNELS)}")
    return PAGED_KERNELS[name](cache, num_query_heads)
