"""Compressed entries kept in this process's memory, in front of the store.

An exact hit from the file store is a 12 MB read, its SHA-256 and a copy for a 2K-token
prompt at budget 256 (10-35 ms on a 2-core machine while rows decode), and the scheduler
looks hits up one after another before their first step. This tier keeps the most
recently used entries as loaded (:class:`StoredPrefill`), up to a byte budget, and hands
the same tensors to every request that reuses them: a decode batch copies a prefill's cache
into its own memory, so nothing writes into them.

An entry enters when it is read from the store (or from the bytes waiting for their write)
and when this process writes it, from the very bytes written, so a hit from memory answers
as a hit from the store. Keys are the store's entry keys (namespace, kind, digest); the
store stays the source of truth for other processes.
"""

from __future__ import annotations

from ragsnap.cache.serialization import StoredPrefill
from ragsnap.cache.tiers.bounded import LruMap


def stored_nbytes(stored: StoredPrefill) -> int:
    """The bytes of ``stored``'s tensors, each storage counted once (kept layers share
    the cache layers' keys and values)."""
    tensors = [t for layer in stored.layers for t in layer]
    for kept in stored.kept:
        tensors += [kept.keys, kept.values, kept.indices]
        tensors += [t for t in (kept.bias, getattr(kept, "exact", None)) if t is not None]
    tensors += [stored.next_logits, *stored.decode_bias.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class HitMemory(LruMap[StoredPrefill]):
    """Loaded compressed entries by entry key, the most recently used up to ``max_bytes``."""

    @staticmethod
    def size_of(value: StoredPrefill) -> int:
        return stored_nbytes(value)
