"""Authenticated, encrypted cache entries: a :class:`KVStore` wrapper with AES-GCM.

A cached KV is as sensitive as the documents it came from (layer-0 values depend on the
token alone, so the text can be read back from them), and a store that anyone can write to
must never answer with a rewritten entry. With a key (``RAGSNAP_CACHE_KEY``) every payload
is sealed before it reaches the backend::

    b"RSKV-AESGCM-1\\n" | nonce (12 bytes) | AES-256-GCM(payload) with its 16-byte tag

The associated data is the entry's place (namespace label, kind, digest), so an entry
copied under another key or tenant fails too. The 256-bit AES key is derived from the
configured secret with HKDF-SHA256, so any passphrase length works. An entry that does
not open (changed bytes, changed metadata, sealed with another key, or not sealed at all)
is deleted and counted by :meth:`KVStore.reject`: a miss, never an answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ragsnap.cache.backends.store import EntryKey, KVStore

MAGIC = b"RSKV-AESGCM-1\n"
NONCE_BYTES = 12
KEY_ENV = "RAGSNAP_CACHE_KEY"
_INFO = b"ragsnap kv cache entry v1"


def derive_key(secret: str | bytes) -> bytes:
    """The 32-byte AES key for ``secret`` (HKDF-SHA256, fixed info, no salt)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    raw = secret.encode("utf-8") if isinstance(secret, str) else secret
    if not raw:
        raise ValueError("the cache key must not be empty")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(raw)


def _associated_data(key: EntryKey) -> bytes:
    return f"{key.label}\x00{key.kind}\x00{key.digest}".encode()


class SealedKVStore(KVStore):
    """``inner`` with every payload encrypted and authenticated under ``secret``."""

    def __init__(self, inner: KVStore, secret: str | bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        super().__init__()
        self.inner = inner
        self.scheme = inner.scheme
        self.rejections = inner.rejections  # one count for the backend's and our rejections
        self._aead = AESGCM(derive_key(secret))

    def seal(self, key: EntryKey, payload: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, payload, _associated_data(key))

    def open(self, key: EntryKey, sealed: bytes) -> bytes | None:
        """The payload, or None when ``sealed`` is not an intact entry of ``key``."""
        from cryptography.exceptions import InvalidTag

        head = len(MAGIC) + NONCE_BYTES
        if len(sealed) < head + 16 or sealed[: len(MAGIC)] != MAGIC:
            return None
        nonce = sealed[len(MAGIC) : head]
        try:
            return self._aead.decrypt(nonce, sealed[head:], _associated_data(key))
        except InvalidTag:
            return None

    def get(self, key: EntryKey) -> bytes | None:
        sealed = self.inner.get(key)
        if sealed is None:
            return None
        payload = self.open(key, sealed)
        if payload is None:
            self.reject(key, "unauthenticated")
        return payload

    def put(self, key: EntryKey, payload: bytes) -> bool:
        return self.inner.put(key, self.seal(key, payload))

    def delete(self, key: EntryKey) -> None:
        self.inner.delete(key)

    def clear(self, namespace: str | None = None) -> int:
        return self.inner.clear(namespace)

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        return {**self.inner.stats(namespace), "sealed": True}

    def ping(self, timeout_s: float = 0.5) -> bool:
        return self.inner.ping(timeout_s)

    def close(self) -> None:
        self.inner.close()

    @property
    def enabled(self) -> bool:
        return self.inner.enabled

    @property
    def available(self) -> bool:
        return self.inner.available

    def describe(self) -> str:
        return self.inner.describe()

    @contextmanager
    def exclusive(self, key: EntryKey, wait_s: float = 300.0) -> Iterator[None]:
        with self.inner.exclusive(key, wait_s):
            yield
