"""TOVA (Oren et al., arXiv 2401.06104): keep the keys the current token attends to most."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragsnap.compression.base import LayerContext, ScorerPress
from ragsnap.compression.snapkv import window_attention


@dataclass
class TOVAPress(ScorerPress):
    """Token Omission Via Attention, applied once at the end of prefill.

    The score of a prefix key is the last prompt query's attention to it (softmax over all
    keys, float32), averaged over every query head of the layer: TOVA takes one decision
    per layer, so all KV heads keep the same positions. The last ``window`` positions stay.
    """

    name = "tova"

    def score(self, layer: LayerContext) -> torch.Tensor:
        prefix = layer.seq_len - min(self.window, layer.seq_len)
        # the last prompt query (and drafted ones, averaged, under LookaheadPress)
        last = window_attention(layer, 1)[..., :prefix].mean(dim=-2)  # [B, Hkv, G, P]
        mean = last.mean(dim=(1, 2), keepdim=True).squeeze(2)  # [B, 1, P]
        return mean.expand(-1, layer.num_kv_heads, -1)  # [B, Hkv, P]
