"""The KV store interface: bytes in, bytes out, under a namespaced entry key.

A store knows nothing about tensors (:mod:`ragsnap.cache.serialization` does); it keeps
opaque payloads, verifies their checksum on read, and reports a damaged or partial entry
as a miss after deleting it. Backends are chosen by URL scheme and imported lazily, so
redis-py stays an optional dependency:

``redis://`` / ``rediss://`` / ``unix://``  -> :class:`~ragsnap.cache.backends.redis_store.RedisKVStore`
``file://PATH``                             -> :class:`~ragsnap.cache.backends.file_store.FileKVStore`
``none``                                    -> :class:`NullKVStore` (caching off)
"""

from __future__ import annotations

import logging
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from ragsnap.cache.tiers.single_flight import KeyedLocks
from ragsnap.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_URL_ENV = "RAGSNAP_CACHE_URL"
CACHE_KEY_ENV = "RAGSNAP_CACHE_KEY"
DEFAULT_NAMESPACE = "default"
_SAFE_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class StoreUnavailable(Exception):
    """The backend cannot be reached right now (the caller answers without the cache)."""


def namespace_label(namespace: str | None) -> str:
    """A namespace as it appears in storage keys and paths: itself when it is short and
    plain, else a digest of it (an API key, say, never lands in a key or a file name).
    A leading dot is never plain: names like ``.locks`` belong to the stores themselves."""
    import hashlib

    namespace = namespace or DEFAULT_NAMESPACE
    if _SAFE_NAMESPACE.match(namespace) and not namespace.startswith("."):
        return namespace
    return "h-" + hashlib.sha256(namespace.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class EntryKey:
    """Where one cache entry lives: tenant ``namespace``, ``kind`` of entry, content ``digest``.

    ``kind`` is ``"kv"`` (a compressed prompt cache) or ``"prefix"`` (the full KV of a
    document prefix); ``digest`` is a sha256 hex string from :mod:`ragsnap.cache.keys`.
    """

    namespace: str
    kind: str
    digest: str

    @property
    def label(self) -> str:
        return namespace_label(self.namespace)


class KVStore(ABC):
    """A byte store for cache entries. Thread-safe; every method may raise
    :class:`StoreUnavailable` when the backend cannot be reached."""

    scheme: str = ""

    def __init__(self) -> None:
        self._flights = KeyedLocks()
        # entries found unusable and deleted, by reason (read by /metrics)
        self.rejections: dict[str, int] = {}
        self._rejections_lock = threading.Lock()

    def reject(self, key: EntryKey, reason: str) -> None:
        """Count ``key`` as unusable (damaged, tampered, unreadable) and delete it; never raises."""
        logger.warning("cache entry %s rejected (%s); deleting it", key.digest[:12], reason)
        with self._rejections_lock:
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
        try:
            self.delete(key)
        except Exception as exc:  # a cache must never fail a request
            logger.warning("cannot delete cache entry %s: %s", key.digest[:12], exc)

    def ping(self, timeout_s: float = 0.5) -> bool:
        """Whether the backend answers now (at most ``timeout_s``); local stores always do."""
        return self.available

    @abstractmethod
    def get(self, key: EntryKey) -> bytes | None:
        """The payload stored under ``key``; None when absent, partial or damaged (then deleted)."""

    @abstractmethod
    def put(self, key: EntryKey, payload: bytes) -> bool:
        """Store ``payload``; False when the backend refused it (full, out of memory)."""

    @abstractmethod
    def delete(self, key: EntryKey) -> None:
        """Remove the entry (no error when it is absent)."""

    @abstractmethod
    def clear(self, namespace: str | None = None) -> int:
        """Remove every entry of ``namespace`` (every ragsnap entry when None); returns how many."""

    @abstractmethod
    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """Backend, state (ok/unavailable), entries and bytes (of ``namespace`` when given)."""

    def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        """Release connections and files."""

    @property
    def enabled(self) -> bool:
        return True

    @property
    def available(self) -> bool:
        """False while the backend is known to be unreachable (checked again after a backoff)."""
        return True

    def describe(self) -> str:
        """The store's URL without credentials, for logs and reports."""
        return self.scheme

    def public_name(self) -> str:
        """What a response may say about the store: its kind only (no host, port, database,
        credentials or server path)."""
        return self.scheme or "none"

    @contextmanager
    def exclusive(self, key: EntryKey, wait_s: float = 300.0) -> Iterator[None]:
        """Hold the computation of ``key``: one holder per key in this process (and across
        processes where the backend can lock). Waits at most ``wait_s``, then proceeds anyway."""
        with self._local_lock(key, wait_s):
            yield

    @contextmanager
    def exclusive_many(self, keys: Iterable[EntryKey], wait_s: float = 300.0) -> Iterator[None]:
        """Hold several keys at once (each key once), taken in digest order: two holders of
        overlapping sets, in this process or another, never wait on each other forever."""
        with ExitStack() as held:
            for key in sorted(set(keys), key=lambda k: (k.digest, k.namespace, k.kind)):
                held.enter_context(self.exclusive(key, wait_s))
            yield

    @contextmanager
    def _local_lock(self, key: EntryKey, wait_s: float) -> Iterator[bool]:
        with self._flights.hold(key, wait_s) as acquired:
            yield acquired

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullKVStore(KVStore):
    """Caching off: nothing is kept, every lookup misses."""

    scheme = "none"

    def get(self, key: EntryKey) -> bytes | None:
        return None

    def put(self, key: EntryKey, payload: bytes) -> bool:
        return False

    def delete(self, key: EntryKey) -> None:
        return None

    def clear(self, namespace: str | None = None) -> int:
        return 0

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        return {"backend": "none", "state": "off", "entries": 0, "bytes": 0}

    @property
    def enabled(self) -> bool:
        return False


def parse_size(text: str) -> int:
    """``"4096"``, ``"512MB"``, ``"2GiB"`` -> bytes. Raises :class:`ConfigError`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"cannot read a size from {text!r} (e.g. 512MB, 4GB)", field="max_bytes")
    number, unit = float(match.group(1)), (match.group(2) or "").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(number * scale)
