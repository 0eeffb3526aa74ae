"""Key norm (Devoto et al., arXiv 2406.11430): keys with a low L2 norm draw high attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragsnap.compression.base import LayerContext, ScorerPress


@dataclass
class KeyNormPress(ScorerPress):
    """Keep the prefix keys with the smallest L2 norm per KV head, plus the window.

    Query-agnostic and attention-free: the score is ``-||k||`` of the cached (RoPE-applied)
    key, ``[B, Hkv, L - w]``, computed in float32.
    """

    name = "knorm"

    def score(self, layer: LayerContext) -> torch.Tensor:
        prefix = layer.seq_len - min(self.window, layer.seq_len)
        return -layer.keys[..., :prefix, :].float().norm(dim=-1)
