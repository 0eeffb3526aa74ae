"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragsnap.compression.base import LayerContext, ScorerPress
from ragsnap.errors import ConfigError


@dataclass
class StreamingLLMPress(ScorerPress):
    """Keep the first ``sinks`` positions and the most recent ones; blind to the question."""

    name = "streamingllm"
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"sinks must be >= 0, got {self.sinks}", field="sinks")

    def score(self, layer: LayerContext) -> torch.Tensor:
        batch, heads = layer.keys.shape[:2]
        prefix = layer.seq_len - min(self.window, layer.seq_len)
        # increasing with position (recent wins), sinks above everything
        scores = torch.arange(prefix, device=layer.keys.device, dtype=torch.float32)
        scores[: self.sinks] = float(prefix)
        return scores.expand(batch, heads, -1)
