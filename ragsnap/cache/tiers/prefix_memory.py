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

from collections.abc import Sequence

import torch

from ragsnap.cache.tiers.bounded import LruMap

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def layers_nbytes(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


class PrefixMemory(LruMap[Layers]):
    """Prefix layers (``[1, Hkv, n, D]`` keys and values per layer) by entry key, the most
    recently used up to ``max_bytes`` in all."""

    @staticmethod
    def size_of(value: Layers) -> int:
        return layers_nbytes(value)
