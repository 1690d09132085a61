"""vattn: a vAttention-style KV cache - virtually contiguous KV, physical pages on demand."""

from vattn.config import KVCacheConfig
from vattn.errors import CapacityError, ConfigurationError, OutOfPagesError, OutOfSlotsError, UnavailableError
from vattn.kv_cache import KVCache
from vattn.page_budget import PageBudget
from vattn.stats import CacheStats

__all__ = [
    "CacheStats",
    "CapacityError",
    "ConfigurationError",
    "KVCache",
    "KVCacheConfig",
    "OutOfPagesError",
    "OutOfSlotsError",
    "PageBudget",
    "UnavailableError",
]
