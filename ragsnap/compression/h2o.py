"""H2O-style heavy hitters (Zhang et al., arXiv 2306.14048): attention accumulated over the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragsnap.compression.base import LayerContext, ScorerPress


@dataclass
class H2OPress(ScorerPress):
    """Keep the keys that received the most attention from all prompt queries, plus the window.

    Causal attention of every query of this forward pass, summed per key and averaged over
    each KV group. Computed in query chunks of ``chunk`` so memory stays ``O(chunk * L)``
    per head rather than ``O(L^2)``.
    """

    name = "h2o"
    window_only = False  # every prompt query votes
    chunk: int = 512

    def score(self, layer: LayerContext) -> torch.Tensor:
        seq_len = layer.seq_len
        # the accumulated attention does not depend on the budget: several H2O presses
        # scoring the same layer (one prefill, several budgets) compute it once
        memo = f"h2o-totals:{self.chunk}"
        if memo not in layer._memo:
            layer._memo[memo] = self._totals(layer)
        return layer._memo[memo][..., : seq_len - min(self.window, seq_len)]

    def _totals(self, layer: LayerContext) -> torch.Tensor:
        """Attention received by every key, summed over the queries: ``[B, Hkv, L]``."""
        seq_len = layer.seq_len
        queries = layer.queries().float()  # [B, Hq, q, D]
        batch, _, n_queries, dim = queries.shape
        grouped = queries.view(batch, layer.num_kv_heads, layer.group_size, n_queries, dim)
        keys = layer.keys.float()
        offset = seq_len - n_queries  # positions of this forward start after a reused prefix
        positions = torch.arange(seq_len, device=keys.device)
        totals = torch.zeros(batch, layer.num_kv_heads, seq_len, device=keys.device)
        for start in range(0, n_queries, self.chunk):
            block = grouped[..., start : start + self.chunk, :]
            logits = torch.einsum("bhgqd,bhld->bhgql", block, keys) * layer.scaling
            query_pos = offset + torch.arange(start, start + block.shape[-2], device=keys.device)
            logits.masked_fill_(positions[None, :] > query_pos[:, None], float("-inf"))
            totals += logits.softmax(dim=-1).sum(dim=-2).mean(dim=2)
        return totals
