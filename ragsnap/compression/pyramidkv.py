"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV scores, budgets shrinking with depth."""

from __future__ import annotations

from dataclasses import dataclass

from ragsnap.compression.base import LayerContext
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.errors import ConfigError


@dataclass
class PyramidKVPress(SnapKVPress):
    """SnapKV selection with a linear per-layer budget: lower layers keep more, upper fewer.

    The non-window budget ``c = budget - window`` runs from ``2c - c/beta`` at layer 0 down
    to ``c/beta`` at the last layer, so the total over layers equals the uniform budget.
    """

    name = "pyramidkv"
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ConfigError(f"beta must be >= 1, got {self.beta}", field="beta")

    def layer_budget(self, layer: LayerContext) -> int:
        uniform = super().layer_budget(layer)
        free = uniform - self.window
        if layer.num_layers == 1 or free <= 0:
            return uniform
        low = free / self.beta
        high = 2 * free - low
        if high > layer.seq_len - self.window:  # prompt too short for the pyramid's top
            return uniform
        step = (high - low) / (layer.num_layers - 1)
        return self.window + round(high - step * layer.layer_idx)
