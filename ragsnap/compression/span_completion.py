"""Span completion: a kept word start keeps the rest of its word.

Query-aware scores find the key word of a fact and the first digits of a number, but
pooling reaches only ``kernel // 2`` tokens: the model then copies a truncated number
("7007" for 7007071), the "phone number" failure of SnapKV (arXiv 2404.14469, sec. 4).
Carrying each word's best score forward along the word keeps the whole word instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.compression.base import (
    CompressedLayer,
    LayerContext,
    ScorerPress,
    WrapperPress,
    keep_all,
    keep_top,
    protect,
)
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.compression.words import carry_forward, segment_ids
from ragsnap.errors import ConfigError


@dataclass
class SpanCompletionPress(WrapperPress):
    """Wrap a scorer press: scores run forward along whitespace-delimited words, then top-k.

    Words longer than ``max_word_tokens`` are completed in pieces of that size. Entries
    kept only because of completion are marked ``exact`` so a value refit leaves them be.
    Without word boundaries (``LayerContext.word_starts`` is None) this is the base press.
    """

    name = "wordspan"
    base: ScorerPress = field(default_factory=SnapKVPress)
    max_word_tokens: int = 12

    def __post_init__(self) -> None:
        if self.max_word_tokens < 1:
            raise ConfigError("max_word_tokens must be at least 1", field="max_word_tokens")

    def config(self) -> dict[str, Any]:
        return {**self.base.config(), "press": self.name, "max_word_tokens": self.max_word_tokens}

    def layer_budget(self, layer: LayerContext) -> int:
        """The base press's budget for ``layer`` (window included)."""
        return self.base.layer_budget(layer)

    def completed_scores(self, layer: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The base press's scores and the word-completed ones, each ``[B, Hkv, L - w]``
        (the same tensor twice without word boundaries)."""
        scores = self.base.score(layer)
        if layer.word_starts is None:
            return scores, scores
        prefix = scores.shape[-1]
        segments = segment_ids(layer.word_starts[:prefix], self.max_word_tokens)
        return scores, carry_forward(scores, segments, self.max_word_tokens)

    def compress(self, layer: LayerContext) -> CompressedLayer:
        keep = self.base.layer_budget(layer)
        if layer.seq_len <= keep:
            return keep_all(layer)
        if layer.word_starts is None or keep <= self.base.window:  # no words, or only the window
            return keep_top(layer, self.base.score(layer), keep, self.base.window)
        scores, completed = self.completed_scores(layer)  # [B, Hkv, L - w] each
        prefix = scores.shape[-1]
        completed = protect(layer, completed)
        kept = keep_top(layer, completed, keep, self.base.window)
        # kept through completion: own score below the k-th best, carried score at or above it
        threshold = completed.topk(keep - min(self.base.window, layer.seq_len), dim=-1).values[
            ..., -1:
        ]
        boosted = torch.zeros(
            scores.shape[:2] + (layer.seq_len,), dtype=torch.bool, device=scores.device
        )
        boosted[..., :prefix] = (scores < threshold) & (completed >= threshold)
        kept.exact = boosted.gather(-1, kept.indices)
        return kept
