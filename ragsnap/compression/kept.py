"""What a press keeps of a layer: data only (the cache tiers store it without importing a press)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompressedLayer:
    """What a press keeps of one layer.

    ``indices`` are original positions in ascending order per head; ``keys``/``values``
    are the kept entries (a press may refit values); ``bias`` is an optional additive
    attention-logit bias per kept key (0 = none), for methods that re-weight kept keys;
    ``exact`` marks entries whose values a later refit must leave as they are.
    """

    indices: torch.Tensor  # [B, Hkv, n] long, sorted
    keys: torch.Tensor  # [B, Hkv, n, D]
    values: torch.Tensor  # [B, Hkv, n, D]
    bias: torch.Tensor | None = None  # [B, Hkv, n]
    exact: torch.Tensor | None = None  # [B, Hkv, n] bool

    @classmethod
    def gather(
        cls, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
    ) -> CompressedLayer:
        """Keep ``indices`` (``[B, Hkv, n]``) of ``keys``/``values`` (``[B, Hkv, L, D]``)."""
        expanded = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return cls(
            indices=indices,
            keys=keys.gather(2, expanded).contiguous(),
            values=values.gather(2, expanded).contiguous(),
        )
