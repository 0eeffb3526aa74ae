"""Scattered causal attention (the per-document recompute's kernel) equals masked sdpa."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragsnap.runtime.scattered_sdpa import positions_mask, scattered_causal_sdpa


def _reference(query, key, value, positions):  # type: ignore[no-untyped-def]
    mask = positions_mask(positions, key.shape[2], query.dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("group_queries", [1, 5, 48, 1000])
def test_scattered_attention_matches_the_masked_kernel(group_queries: int) -> None:
    torch.manual_seed(0)
    # runs of neighbours, gaps, the first and the last key
    positions = torch.tensor(sorted({0, 1, 2, 299, *range(50, 60), *range(100, 300, 8)}))
    query = torch.randn(1, 6, len(positions), 16)
    key, value = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    got = scattered_causal_sdpa(query, key, value, positions, group_queries=group_queries)
    assert torch.allclose(got, _reference(query, key, value, positions), atol=1e-5)


def test_scattered_attention_takes_views_and_a_scale() -> None:
    torch.manual_seed(1)
    query = torch.randn(1, 20, 4, 8).transpose(1, 2)[:, :4]  # [1, 4, 20, 8], not contiguous
    key, value = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    positions = torch.arange(10, 50, 2)
    limit = int(positions[-1]) + 1
    got = scattered_causal_sdpa(
        query, key[:, :, :limit], value[:, :, :limit], positions, scaling=0.3, group_queries=6
    )
    mask = positions_mask(positions, limit, query.dtype)
    want = F.scaled_dot_product_attention(
        query, key[:, :, :limit], value[:, :, :limit], attn_mask=mask, scale=0.3, enable_gqa=True
    )
    assert torch.allclose(got, want, atol=1e-5)
