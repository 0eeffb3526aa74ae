"""SnapKV (Li et al., arXiv 2404.14469): the observation window's queries vote for prefix keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ragsnap.compression.base import DEFAULT_KERNEL, LayerContext, ScorerPress
from ragsnap.errors import ConfigError


def window_attention(layer: LayerContext, window: int) -> torch.Tensor:
    """Attention of the last ``window`` queries over all keys, per query head, followed by
    that of the first ``layer.ahead`` drafted queries (tokens after the prompt: they see
    every key).

    Softmax in float32 over every key, with a causal mask inside the window. Memoized on
    the layer, so presses that build on SnapKV (Attention Matching) reuse it.

    Returns
    -------
    ``[B, Hkv, G, w + ahead, L]`` attention probabilities, grouped by KV head.
    """
    memo_key = f"window_attention:{window}:{layer.ahead}"
    if memo_key not in layer._memo:
        layer._memo[memo_key] = _window_attention(layer, window)
    return layer._memo[memo_key]


def _window_attention(layer: LayerContext, window: int) -> torch.Tensor:
    seq_len = layer.seq_len
    queries = layer.queries(window).float()  # [B, Hq, w, D]
    w = queries.shape[2]
    if layer.ahead:
        assert layer.drafted is not None, "ahead > 0 needs drafted queries"
        queries = torch.cat([queries, layer.drafted[:, :, : layer.ahead].float()], dim=2)
    batch, _, rows, dim = queries.shape
    heads, group = layer.num_kv_heads, layer.group_size
    # a group's queries as the rows of one product per KV head: [B, Hkv, G * rows, L] (the
    # same sums as an einsum over [B, Hkv, G, rows, D], in one GEMM per head, 2-3x sooner)
    grouped = queries.reshape(batch, heads, group * rows, dim)
    logits = torch.matmul(grouped, layer.keys.float().transpose(-1, -2))
    logits = logits.mul_(layer.scaling).view(batch, heads, group, rows, seq_len)
    # query i of the window sits at position L - w + i and must not see later keys
    future = torch.ones(w, w, dtype=torch.bool, device=logits.device).triu(1)
    logits[..., :w, seq_len - w :].masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth ``[B, Hkv, n]`` scores along positions (odd ``kernel``, stride 1, same length)."""
    if kernel <= 1:
        return scores
    flat = scores.flatten(0, 1).unsqueeze(1)  # [B*Hkv, 1, n]
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).view_as(scores)


@dataclass
class SnapKVPress(ScorerPress):
    """Keep the prefix keys the observation window attends to most, plus the window.

    Scores are the window's attention summed over its queries, averaged over the query
    heads of each KV group (selection stays per KV head, no KV repetition: SnapKV issues
    #16/#22), then max- or avg-pooled along positions so neighbours of a hit survive.
    Defaults follow the official experiment configs (window 32, kernel 7, max pooling).
    """

    name = "snapkv"
    kernel: int = DEFAULT_KERNEL
    pooling: Literal["max", "avg"] = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(
                f"kernel must be a positive odd number, got {self.kernel}", field="kernel"
            )
        if self.pooling not in ("max", "avg"):
            raise ConfigError(
                f"pooling must be 'max' or 'avg', got {self.pooling!r}", field="pooling"
            )

    def score(self, layer: LayerContext) -> torch.Tensor:
        window = min(self.window, layer.seq_len)
        attention = window_attention(layer, window)[..., : layer.seq_len - window]
        votes = attention.sum(dim=-2).mean(dim=2)  # [B, Hkv, L - w]
        return pool_scores(votes, self.kernel, self.pooling)
