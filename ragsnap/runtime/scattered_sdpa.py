"""Causal attention of scattered queries on a CPU, without the hidden products.

The per-document tier recomputes a few hundred tokens spread over a ~4K-token prefix
(:func:`ragsnap.runtime.blend.recompute`): the token at position ``p`` sees the keys
``0 .. p``. With an explicit mask the kernel computes every query-key product, the hidden
ones too, so the recompute ran in several position-ordered passes to skip some of them,
each pass reading every weight again. Attention is most of that recompute on the embedded
model (a 170-token pass over 4K keys: ~18 ms per layer masked, against ~3 ms for its
linear layers).

Here the queries (sorted by position) are cut into groups of consecutive ones. Every query
of a group sees all keys up to the group's first position: that part needs no mask and
runs in the flash kernel with each KV head's query heads as one longer query (as
:mod:`ragsnap.runtime.causal_sdpa` does for a prefill chunk). The keys between the group's
first and last positions are seen by some of its queries only: a small masked block,
computed directly. The two parts merge by their log-sum-exp, the same softmax over all
visible keys; the attention work falls towards half of queries x keys in one pass.
"""

from __future__ import annotations

import math

import torch

# queries per group: smaller groups leave fewer masked products, more kernel calls
GROUP_QUERIES = 48


def scattered_causal_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scaling: float | None = None,
    group_queries: int = GROUP_QUERIES,
) -> torch.Tensor:
    """Attention of queries at ``positions`` each over the keys at or before its position.

    Parameters
    ----------
    query : ``[1, Hq, q, D]``, the queries of positions ``positions`` (in that order).
    key, value : ``[1, Hkv, kv, D]``, ``Hq`` a multiple of ``Hkv``; key ``j`` is at position ``j``.
    positions : ``[q]`` long, strictly increasing, each ``< kv``.
    scaling : the logits' scale (default ``D ** -0.5``).

    Returns
    -------
    ``[1, Hq, q, D]`` in ``query``'s dtype: what sdpa gives with the mask that hides key
    ``j`` from query ``i`` when ``j > positions[i]`` (up to float rounding).
    """
    _, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    at = positions.tolist()
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    count = max(1, math.ceil(q / max(1, group_queries)))
    bounds = [round(i * q / count) for i in range(count + 1)]
    out = torch.empty_like(query)
    for s, e in zip(bounds, bounds[1:], strict=False):
        if e <= s:
            continue
        n, first, last = e - s, at[s], at[e - 1]
        part = query[:, :, s:e]
        # every query of the group sees keys 0 .. first: no mask
        seen, seen_lse = flash(
            part.reshape(1, kv_heads, group * n, dim),
            key[:, :, : first + 1],
            value[:, :, : first + 1],
            0.0,
            False,
            scale=scale,
        )[:2]
        if last == first:
            out[:, :, s:e] = seen.reshape(1, heads, n, dim)
            continue
        seen = seen.reshape(1, heads, n, dim).float()
        seen_lse = seen_lse.reshape(1, heads, n).float()
        # keys first + 1 .. last: query i sees those at or before positions[i]
        k = key[:, :, first + 1 : last + 1]
        v = value[:, :, first + 1 : last + 1]
        grouped = part.reshape(1, kv_heads, group * n, dim)
        logits = (grouped @ k.transpose(-1, -2)).float().mul_(scale)  # [1, Hkv, group*n, m]
        logits = logits.view(1, kv_heads, group, n, -1)
        where = torch.arange(first + 1, last + 1, device=key.device).view(1, -1)
        hidden = where > positions[s:e].view(-1, 1)  # [n, m]
        logits.masked_fill_(hidden, float("-inf"))
        logits = logits.view(1, heads, n, -1)
        top = torch.maximum(logits.amax(dim=-1), seen_lse)  # finite: seen_lse is
        weights = (logits - top.unsqueeze(-1)).exp_()  # hidden keys weigh 0
        extra = (weights.view(1, kv_heads, group * n, -1).to(v.dtype) @ v).float()
        extra = extra.view(1, heads, n, dim)
        kept = (seen_lse - top).exp_()
        total = kept + weights.sum(dim=-1)
        merged = (seen * kept.unsqueeze(-1) + extra) / total.unsqueeze(-1)
        out[:, :, s:e] = merged.to(out.dtype)
    return out


def positions_mask(positions: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, q, keys]`` additive mask: ``-inf`` where key ``j`` lies after ``positions[i]``."""
    visible = torch.arange(keys, device=positions.device).view(1, -1) <= positions.view(-1, 1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, float("-inf")).view(1, 1, *visible.shape)


__all__ = ["GROUP_QUERIES", "positions_mask", "scattered_causal_sdpa"]
