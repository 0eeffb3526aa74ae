"""The compressed-KV cache: stores (Redis, on disk, none), serialization, keys, cached prefill."""

from __future__ import annotations

from ragsnap.cache.backends.factory import default_cache_url, open_store
from ragsnap.cache.backends.store import (
    CACHE_URL_ENV,
    DEFAULT_NAMESPACE,
    EntryKey,
    KVStore,
    NullKVStore,
    StoreUnavailable,
)

__all__ = [
    "CACHE_URL_ENV",
    "DEFAULT_NAMESPACE",
    "EntryKey",
    "KVStore",
    "NullKVStore",
    "StoreUnavailable",
    "default_cache_url",
    "open_store",
]
