"""The paged baseline: a block-table KV cache (as vLLM's PagedAttention) and its kernels,
built to the same standard as the virtual cache so the paper's comparisons are fair."""

from vattn.paged.paged_cache import PagedKVCache, PagedKVCacheConfig
from vattn.paged.paged_kernels import PAGED_KERNELS, PagedBatch, make_paged_kernel

__all__ = ["PAGED_KERNELS", "PagedBatch", "PagedKVCache", "PagedKVCacheConfig", "make_paged_kernel"]
