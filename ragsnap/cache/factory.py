"""The store URL factory: ``redis://``, ``rediss://``, ``unix://``, ``file://`` or ``none``.

Backends are imported only when their scheme is asked for, so optional dependencies
(redis-py, cryptography) stay optional.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs

from ragsnap.cache.store import CACHE_KEY_ENV, CACHE_URL_ENV, KVStore, NullKVStore, parse_size
from ragsnap.errors import ConfigError


def default_cache_dir() -> Path:
    """The on-disk store's home under the user's cache directory."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("ragsnap")) / "kv"


def default_cache_url() -> str:
    """``$RAGSNAP_CACHE_URL`` when set, else a file store under the user's cache directory."""
    return os.environ.get(CACHE_URL_ENV) or f"file://{default_cache_dir()}"


def _query(url: str) -> tuple[str, dict[str, str]]:
    base, _, query = url.partition("?")
    return base, {k: v[-1] for k, v in parse_qs(query).items()}


def open_store(url: str | None = None, key: str | None = None) -> KVStore:
    """The store for ``url``: ``redis://``, ``rediss://``, ``unix://``, ``file://PATH`` or ``none``.

    ``None`` (or an empty string) means :func:`default_cache_url`. Query options:
    ``ttl`` (seconds, Redis), ``max_bytes`` (file store cap, accepts ``512MB``/``4GB``).
    ``key`` (default ``$RAGSNAP_CACHE_KEY``) encrypts and authenticates every entry
    (:class:`~ragsnap.cache.sealed.SealedKVStore`). Never connects: an unreachable Redis
    shows up later as ``unavailable``. Raises :class:`ConfigError` for a URL it cannot use.
    """
    store = _open_backend(url)
    secret = key if key is not None else os.environ.get(CACHE_KEY_ENV, "")
    if not secret or not store.enabled:
        return store
    try:
        from ragsnap.cache.sealed import SealedKVStore
    except ImportError as exc:
        raise ConfigError(
            "a cache key needs the cryptography package: pip install cryptography",
            field="cache_key",
        ) from exc
    return SealedKVStore(store, secret)


def _open_backend(url: str | None) -> KVStore:
    url = (url or "").strip() or default_cache_url()
    scheme = url.split(":", 1)[0].lower() if ":" in url else url.lower()
    if scheme in {"none", "off", "disabled"}:
        return NullKVStore()
    if scheme in {"redis", "rediss", "unix"}:
        try:
            from ragsnap.cache.redis_store import RedisKVStore
        except ImportError as exc:
            raise ConfigError(
                "a redis:// cache needs redis-py: pip install 'ragsnap[redis]'", field="cache"
            ) from exc
        try:
            return RedisKVStore.from_url(url)
        except ValueError as exc:  # a bad ttl=, chunk_bytes=, backoff= or redis-py option
            raise ConfigError(f"bad cache URL option: {exc}", field="cache") from exc
    if scheme == "file":
        from ragsnap.cache.file_store import FileKVStore

        base, options = _query(url)
        path = base[len("file://") :] if base.lower().startswith("file://") else base[5:]
        if not path:
            raise ConfigError(
                "a file:// cache URL needs a directory: file:///path/to/dir", field="cache"
            )
        max_bytes = options.get("max_bytes")
        return FileKVStore(
            Path(path).expanduser(),
            max_bytes=parse_size(max_bytes) if max_bytes else None,
        )
    raise ConfigError(
        f"unsupported cache URL scheme {scheme!r} "
        "(use redis://, rediss://, unix://, file:// or none)",
        field="cache",
    )
