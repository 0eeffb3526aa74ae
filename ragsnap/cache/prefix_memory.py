"""Document prefixes kept in this process's memory, in front of the store.

A new question over documents seen moments ago needs their full prefix KV (about 94 MB for
2K tokens of the embedded model in float32). From the file store that is a read, a
checksum and a copy (about 0.3 s on a 2-core machine); from Redis, a transfer as well. This
tier keeps the most recently used prefixes as tensors, up to a byte budget, and hands the
same tensors to every request that reuses them. Nothing writes into them: a prefix hit
copies them into its batch, and a model cache built on them appends by concatenation.

Entries are keyed by the store's entry key (namespace, kind, digest), so tenants and model
identities stay apart exactly as in the store, which remains the source of truth for other
processes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ragsnap.cache.bounded import BoundedMap

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def layers_nbytes(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


class PrefixMemory(BoundedMap[Layers]):
    """A thread-safe LRU of prefix layers (``[1, Hkv, n, D]`` keys and values per layer),
    at most ``max_bytes`` in all; 0 keeps nothing."""

    def get(self, key: Hashable) -> Layers | None:
        with self._lock:
            layers = self._entries.get(key)
            if layers is not None:
                self._entries.move_to_end(key)
            return layers

    def put(self, key: Hashable, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Keep ``layers`` under ``key`` (evicting the least recently used); False when
        they alone exceed the budget."""
        size = layers_nbytes(layers)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= layers_nbytes(old)
            while self._entries and self._bytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= layers_nbytes(evicted)
            self._entries[key] = list(layers)
            self._bytes += size
        return True
