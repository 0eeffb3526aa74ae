"""Cache entries in Redis: chunked values, the manifest written last in one MULTI/EXEC.

Keys (``{digest}`` is a Redis Cluster hash tag, so an entry's parts share a slot)::

    ragsnap:v1:<namespace>:<kind>:{<digest>}:manifest   JSON: chunks, bytes, sha256
    ragsnap:v1:<namespace>:<kind>:{<digest>}:chunk:<i>  the payload, a few MiB per chunk
    ragsnap:v1:<namespace>:<kind>:{<digest>}:lock       single flight across processes

Every part carries a TTL. A missing chunk or a checksum mismatch reads as a miss and the
entry is deleted. When Redis cannot be reached, calls raise :class:`StoreUnavailable` and
the store stays quiet for a growing backoff before it tries the connection again.
Run Redis as a cache: ``maxmemory`` with ``allkeys-lru``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import LockError
from redis.retry import Retry

from ragsnap.cache.backends.store import (
    EntryKey,
    KVStore,
    StoreUnavailable,
    namespace_label,
    parse_size,
)
from ragsnap.errors import ConfigError

logger = logging.getLogger(__name__)

KEY_ROOT = "ragsnap:v1"
DEFAULT_TTL_S = 7 * 24 * 3600
DEFAULT_CHUNK_BYTES = 4 * 2**20
LOCK_TTL_S = 120.0
_POLL_S = 0.05
_MAX_CHUNKS = 1 << 16  # 256 GiB at the default chunk size: a larger count is a forged manifest
_OWN_OPTIONS = ("ttl", "chunk_bytes", "backoff", "max_backoff", "socket_timeout")
T = TypeVar("T")
N = TypeVar("N", int, float)


def _number(text: str, name: str, kind: type[N]) -> N:
    """A query option as a number; a ValueError that names the option otherwise."""
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}={text!r} is not a finite number")
    return value


class RedisKVStore(KVStore):
    """A :class:`KVStore` on Redis (``redis://``, ``rediss://`` or ``unix://``)."""

    scheme = "redis"

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        socket_timeout_s: float = 2.0,
    ) -> None:
        super().__init__()
        if ttl_s < 1 or chunk_bytes < 1:
            raise ValueError("ttl and chunk_bytes must be positive")
        if not (0 <= backoff_s <= 3600 and 0 <= max_backoff_s <= 86400):
            raise ValueError("backoff and max_backoff must be between 0 and an hour / a day")
        if not 0 < socket_timeout_s <= 600:
            raise ValueError("socket_timeout must be between 0 and 600 seconds")
        self.url = url
        self.ttl_s = int(ttl_s)
        self.chunk_bytes = int(chunk_bytes)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # no client-side retries: an unreachable server must cost one short timeout, not several
        self.client = redis.Redis.from_url(
            url,
            socket_connect_timeout=min(1.0, socket_timeout_s),
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._ping_client: redis.Redis | None = None
        self._state_lock = threading.Lock()
        self._failures = 0
        self._down_until = 0.0

    @classmethod
    def from_url(cls, url: str) -> RedisKVStore:
        """Build from a URL; ``ttl``, ``chunk_bytes``, ``backoff``, ``max_backoff`` and
        ``socket_timeout`` (seconds, default 2) query options are ours, every other option
        goes to redis-py."""
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        own = {k: query.pop(k) for k in _OWN_OPTIONS if k in query}
        kwargs: dict[str, Any] = {}
        if "ttl" in own:
            kwargs["ttl_s"] = _number(own["ttl"], "ttl", int)
        if "chunk_bytes" in own:
            try:
                kwargs["chunk_bytes"] = parse_size(own["chunk_bytes"])
            except ConfigError as exc:
                raise ValueError(f"chunk_bytes: {exc}") from None
        if "backoff" in own:
            kwargs["backoff_s"] = _number(own["backoff"], "backoff", float)
        if "max_backoff" in own:
            kwargs["max_backoff_s"] = _number(own["max_backoff"], "max_backoff", float)
        if "socket_timeout" in own:  # a frozen server costs one such wait, then the backoff
            kwargs["socket_timeout_s"] = _number(own["socket_timeout"], "socket_timeout", float)
        return cls(urlunsplit(parts._replace(query=urlencode(query))), **kwargs)

    def describe(self) -> str:
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    # -- availability -----------------------------------------------------------------

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def ping(self, timeout_s: float = 0.5) -> bool:
        """Ask Redis now, whatever the backoff says, with its own short timeout; a failure
        starts (or extends) the backoff, an answer ends it."""
        if self._ping_client is None:
            self._ping_client = redis.Redis.from_url(
                self.url,
                socket_connect_timeout=timeout_s,
                socket_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        try:
            client = self._ping_client
            self._call(lambda _r: client.ping(), check_backoff=False)
        except (StoreUnavailable, redis.RedisError):
            return False
        return True

    def _call(self, operation: Callable[[redis.Redis], T], *, check_backoff: bool = True) -> T:
        if check_backoff and not self.available:
            raise StoreUnavailable(f"redis at {self.describe()} is unavailable (retrying later)")
        try:
            result = operation(self.client)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with self._state_lock:
                self._failures += 1
                wait = min(self.max_backoff_s, self.backoff_s * 2 ** (self._failures - 1))
                self._down_until = time.monotonic() + wait
            logger.warning("redis cache unreachable (%s); retrying in %.1fs", exc, wait)
            raise StoreUnavailable(str(exc)) from exc
        if self._failures:
            with self._state_lock:
                self._failures, self._down_until = 0, 0.0
            logger.info("redis cache reachable again")
        return result

    # -- keys ------------------------------------------------------------------------

    @staticmethod
    def _base(key: EntryKey) -> str:
        return f"{KEY_ROOT}:{key.label}:{key.kind}:{{{key.digest}}}"

    def _chunk_keys(self, key: EntryKey, count: int) -> list[str]:
        base = self._base(key)
        return [f"{base}:chunk:{i}" for i in range(count)]

    # -- entries ----------------------------------------------------------------------

    def get(self, key: EntryKey) -> bytes | None:
        base = self._base(key)
        raw = self._call(lambda r: r.get(f"{base}:manifest"))
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
            count, size, digest = (
                int(manifest["chunks"]),
                int(manifest["bytes"]),
                manifest["sha256"],
            )
            if not (0 <= count <= min(size, _MAX_CHUNKS) and size >= 0):
                raise ValueError("chunk count out of range")
        except (ValueError, KeyError, TypeError):
            self.reject(key, "manifest")
            return None
        names = self._chunk_keys(key, count)
        # decode_responses is off, so every value is bytes or None
        chunks: list[Any] = self._call(lambda r: r.mget(names)) if count else []
        if any(c is None for c in chunks):
            logger.warning("redis cache: %s lost a chunk (evicted?); deleting", base)
            self.delete(key)
            return None
        payload = b"".join(chunks)
        if len(payload) != size or hashlib.sha256(payload).hexdigest() != digest:
            self.reject(key, "checksum")
            return None
        return payload

    def put(self, key: EntryKey, payload: bytes) -> bool:
        base = self._base(key)
        view = memoryview(payload)
        count = -(-len(payload) // self.chunk_bytes)
        manifest = json.dumps(
            {
                "chunks": count,
                "bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
                "created": time.time(),
            }
        )

        def write(r: redis.Redis) -> None:
            pipe = r.pipeline(transaction=True)
            for i, name in enumerate(self._chunk_keys(key, count)):
                pipe.set(
                    name, view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes], ex=self.ttl_s
                )
            pipe.set(
                f"{base}:manifest", manifest, ex=self.ttl_s
            )  # last: readers see all or nothing
            pipe.execute()

        try:
            self._call(write)
        except redis.ResponseError as exc:  # OOM under maxmemory, a read-only replica...
            logger.warning("redis cache refused %s (%d bytes): %s", base, len(payload), exc)
            return False
        return True

    def delete(self, key: EntryKey) -> None:
        base = self._base(key)

        def remove(r: redis.Redis) -> None:
            raw = r.get(f"{base}:manifest")
            count = 0
            if raw is not None:
                try:
                    count = min(int(json.loads(raw)["chunks"]), _MAX_CHUNKS)
                except (ValueError, KeyError, TypeError):
                    count = 0
            names = [f"{base}:manifest", *self._chunk_keys(key, count)]
            if count == 0:  # no usable manifest: find the chunks by pattern
                names += list(r.scan_iter(match=f"{base}:chunk:*", count=1000))
            r.unlink(*names)

        try:
            self._call(remove)
        except redis.ResponseError as exc:
            logger.warning("redis cache: cannot delete %s: %s", base, exc)

    def _scan(self, namespace: str | None, suffix: str = "*") -> list[bytes]:
        pattern = (
            f"{KEY_ROOT}:{namespace_label(namespace)}:{suffix}"
            if namespace is not None
            else f"{KEY_ROOT}:{suffix}"
        )
        return self._call(lambda r: list(r.scan_iter(match=pattern, count=1000)))

    def clear(self, namespace: str | None = None) -> int:
        names = self._scan(namespace)
        entries = sum(1 for n in names if n.endswith(b":manifest"))
        for i in range(0, len(names), 500):
            self._unlink(names[i : i + 500])
        return entries

    def _unlink(self, names: list[bytes]) -> None:
        self._call(lambda r: r.unlink(*names))

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": "redis", "url": self.describe()}
        try:
            manifests = [n for n in self._scan(namespace) if n.endswith(b":manifest")]
            raws = self._call(lambda r: r.mget(manifests)) if manifests else []
            memory = self._call(lambda r: r.info("memory"))
        except StoreUnavailable:
            return {**out, "state": "unavailable", "entries": None, "bytes": None}
        sizes = [int(json.loads(raw)["bytes"]) for raw in raws if raw is not None]
        return {
            **out,
            "state": "ok",
            "entries": len(sizes),
            "bytes": sum(sizes),
            "used_memory": memory.get("used_memory"),
            "maxmemory": memory.get("maxmemory"),
            "maxmemory_policy": memory.get("maxmemory_policy"),
        }

    # -- single flight ----------------------------------------------------------------

    @contextmanager
    def exclusive(self, key: EntryKey, wait_s: float = 300.0) -> Iterator[None]:
        """One computation of ``key`` at a time across processes: a lock with a TTL, polled
        by the others until it is free or the entry exists (then the caller reads it)."""
        with self._local_lock(key, wait_s):
            base = self._base(key)
            # redis-py's lock: a random token, a TTL, and a release only while still ours
            lock = self.client.lock(f"{base}:lock", timeout=LOCK_TTL_S, thread_local=False)
            held = False
            deadline = time.monotonic() + wait_s
            try:
                while time.monotonic() < deadline:
                    held = bool(self._call(lambda _r: lock.acquire(blocking=False)))
                    if held or self._call(lambda r: r.exists(f"{base}:manifest")):
                        break
                    time.sleep(_POLL_S)
            except (StoreUnavailable, redis.ResponseError):
                held = False  # compute without the lock; the cache is off for now anyway
            try:
                yield
            finally:
                if held:
                    try:
                        self._call(lambda _r: lock.release())
                    except (StoreUnavailable, redis.ResponseError, LockError):
                        pass  # it expired (and may be someone else's now): leave it

    def close(self) -> None:
        self.client.close()
        if self._ping_client is not None:
            self._ping_client.close()
