"""The store URL factory: ``redis://``, ``rediss://``, ``unix://``, ``file://`` or ``none``.

Backends are imported only when their scheme is asked for, so optional dependencies
(redis-py) stay optional.

Every store is sealed (encrypted and authenticated, :mod:`ragsnap.cache.backends.sealed`) unless
its URL says ``unsealed=1``: cached KV gives its prompt back (layer-0 keys and values
depend on the token alone), and a store anyone can write to must not answer with a
forged entry. The key is ``RAGSNAP_CACHE_KEY``; without one, a file store makes its own
(:meth:`FileKVStore.sealing_key`), and a shared store (Redis) is refused: its processes
and replicas must agree on the key, so it comes from configuration.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from ragsnap.cache.backends.store import (
    CACHE_KEY_ENV,
    CACHE_URL_ENV,
    KVStore,
    NullKVStore,
    parse_size,
)
from ragsnap.errors import ConfigError

logger = logging.getLogger(__name__)

UNSEALED_OPTION = "unsealed"
_FILE_OPTIONS = ("max_bytes", UNSEALED_OPTION)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def default_cache_dir() -> Path:
    """The on-disk store's home under the user's cache directory."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("ragsnap")) / "kv"


def default_cache_url() -> str:
    """``$RAGSNAP_CACHE_URL`` when set, else a file store under the user's cache directory."""
    return os.environ.get(CACHE_URL_ENV) or f"file://{default_cache_dir()}"


def _query(url: str) -> tuple[str, dict[str, str]]:
    base, _, query = url.partition("?")
    return base, {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}


def _unsealed(url: str) -> tuple[str, bool]:
    """``url`` without its ``unsealed`` option, and whether the option asked for plaintext."""
    base, options = _query(url)
    if UNSEALED_OPTION not in options:
        return url, False
    value = options.pop(UNSEALED_OPTION).strip().lower()
    if value not in _TRUE | _FALSE:
        raise ConfigError(f"bad cache URL option: unsealed={value!r} (use 1 or 0)", field="cache")
    rest = urlencode(options)
    return (f"{base}?{rest}" if rest else base), value in _TRUE


def open_store(url: str | None = None, key: str | None = None) -> KVStore:
    """The store for ``url``: ``redis://``, ``rediss://``, ``unix://``, ``file://PATH`` or ``none``.

    ``None`` (or an empty string) means :func:`default_cache_url`. Query options:
    ``ttl`` (seconds, Redis), ``max_bytes`` (file store cap, accepts ``512MB``/``4GB``),
    ``unsealed=1`` (store plaintext entries: only for a store nobody else can read or write).
    ``key`` (default ``$RAGSNAP_CACHE_KEY``) encrypts and authenticates every entry
    (:class:`~ragsnap.cache.backends.sealed.SealedKVStore`); without one a file store makes its own
    and a Redis store is refused. Never connects: an unreachable Redis shows up later as
    ``unavailable``. Raises :class:`ConfigError` for a URL it cannot use.
    """
    from ragsnap.cache.backends.file_store import FileKVStore
    from ragsnap.cache.backends.sealed import SealedKVStore

    url, unsealed = _unsealed((url or "").strip() or default_cache_url())
    store = _open_backend(url)
    if not store.enabled:
        return store
    secret: str | bytes = key if key is not None else os.environ.get(CACHE_KEY_ENV, "")
    if unsealed:
        if secret:
            raise ConfigError(
                "the cache URL says unsealed=1 but a cache key is set: drop one of them",
                field="cache",
            )
        logger.warning(
            "cache entries at %s are stored UNSEALED: anyone who can read the store can "
            "read the prompts back, and anyone who can write it can forge answers",
            store.describe(),
        )
        return store
    if not secret:
        if not isinstance(store, FileKVStore):
            raise ConfigError(
                f"a shared cache ({store.scheme}://) needs a key that every process using it "
                f"shares: set {CACHE_KEY_ENV} (for example to the output of "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`), or add "
                "unsealed=1 to the URL to store plaintext entries",
                field="cache_key",
            )
        try:
            secret = store.sealing_key()
        except OSError as exc:
            raise ConfigError(
                f"cannot make the cache's key file under {store.root}: {exc.strerror or exc}",
                field="cache",
            ) from exc
    return SealedKVStore(store, secret)


def _open_backend(url: str) -> KVStore:
    scheme = url.split(":", 1)[0].lower() if ":" in url else url.lower()
    if scheme in {"none", "off", "disabled"}:
        return NullKVStore()
    if scheme in {"redis", "rediss", "unix"}:
        try:
            from ragsnap.cache.backends.redis_store import RedisKVStore
        except ImportError as exc:
            raise ConfigError(
                "a redis:// cache needs redis-py: pip install 'ragsnap[redis]'", field="cache"
            ) from exc
        try:
            return RedisKVStore.from_url(url)
        except ValueError as exc:  # a bad ttl=, chunk_bytes=, backoff= or redis-py option
            raise ConfigError(f"bad cache URL option: {exc}", field="cache") from exc
    if scheme == "file":
        from ragsnap.cache.backends.file_store import FileKVStore

        base, options = _query(url)
        path = base[len("file://") :] if base.lower().startswith("file://") else base[5:]
        if not path:
            raise ConfigError(
                "a file:// cache URL needs a directory: file:///path/to/dir", field="cache"
            )
        unknown = sorted(set(options) - set(_FILE_OPTIONS))
        if unknown:
            raise ConfigError(
                f"unknown file:// cache URL option {unknown[0]!r} (known: max_bytes, unsealed)",
                field="cache",
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
