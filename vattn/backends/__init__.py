"""Virtual-memory backends: where physical pages come from and how they are mapped."""

from __future__ import annotations

from vattn.backends.base import VMMBackend
from vattn.config import KVCacheConfig

BACKENDS = ("host", "cuda")


def make_backend(config: KVCacheConfig) -> VMMBackend:
    if config.backend == "host":
        from vattn.backends.host import HostBackend

        return HostBackend(
            config.page_size, config.pool_pages, config.num_buffers, config.reservation_bytes, config.native
        )
    if config.backend == "cuda":
        from vattn.backends.cuda import CudaBackend

        return CudaBackend(config.page_size, config.pool_pages, config.native)
    raise ValueError(f"unknown backend {config.backend!r}; available: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "VMMBackend", "make_backend"]
