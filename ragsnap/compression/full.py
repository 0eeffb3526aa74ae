"""The full cache: keeps everything; the reference every other press is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragsnap.compression.base import CompressedLayer, LayerContext, Press


@dataclass
class FullPress(Press):
    """No compression: every position of every head is kept."""

    name = "full"

    def compress(self, layer: LayerContext) -> CompressedLayer:
        batch, heads = layer.keys.shape[:2]
        indices = torch.arange(layer.seq_len, device=layer.keys.device).expand(batch, heads, -1)
        return CompressedLayer(indices=indices, keys=layer.keys, values=layer.values)
