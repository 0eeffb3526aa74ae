"""Random selection: the floor any informed press has to beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragsnap.compression.base import LayerContext, ScorerPress


@dataclass
class RandomPress(ScorerPress):
    """Keep uniformly random prefix positions (per layer and head) plus the window.

    Deterministic for a given ``seed`` and layer, so runs and cache entries are reproducible.
    """

    name = "random"
    seed: int = 0

    def score(self, layer: LayerContext) -> torch.Tensor:
        batch, heads = layer.keys.shape[:2]
        prefix = layer.seq_len - min(self.window, layer.seq_len)
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer.layer_idx)
        return torch.rand(batch, heads, prefix, generator=generator).to(layer.keys.device)
