"""Rows of very different cache lengths attend in runs of like widths over views of the
batch's buffers (a few sdpa calls per layer, not one per row), with the result of one
padded call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragsnap.runtime import attention
from ragsnap.runtime.attention import masked_sdpa, width_runs


def test_runs_bound_the_padding_and_cover_every_row_once():
    widths = [300, 310, 290, 4096, 4000, 305, 299, 2000]
    runs = width_runs(widths)
    assert runs == [(0, 3), (3, 5), (5, 7), (7, 8)]
    for start, end in runs:
        assert min(widths[start:end]) >= 0.6 * max(widths[start:end])
    assert width_runs([512] * 64) == [(0, 64)]
    assert width_runs([100, 200]) == [(0, 1), (1, 2)]


def test_ragged_rows_match_one_padded_call_in_few_calls(monkeypatch):
    torch.manual_seed(0)
    widths = (40, 45, 38, 600, 590, 42, 41, 44, 300, 39)
    rows, hq, hkv, q, d, kv = len(widths), 4, 2, 1, 8, max(widths)
    query = torch.randn(rows, hq, q, d)
    key, value = torch.randn(rows, hkv, kv, d), torch.randn(rows, hkv, kv, d)
    mask = torch.zeros(rows, 1, q, kv)
    for r, w in enumerate(widths):
        mask[r, :, :, w:] = float("-inf")
    mask[3, :, :, 5] = 0.7  # a bias on some kept key
    padded = masked_sdpa(query, key, value, mask)  # no widths: one padded call
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    ragged = masked_sdpa(query, key, value, mask, widths=widths)
    assert torch.allclose(ragged, padded, atol=1e-6)
    assert calls == [3, 2, 3, 1, 1]  # the runs of like widths, never one call per row


def test_stacked_query_heads_give_each_query_head_its_kv_head_and_mask_row():
    """Several queries per row: the query heads of a KV head are stacked along the query
    axis; the result is that of every query head attending its own KV head, with a causal
    mask and a per-KV-head bias."""
    torch.manual_seed(1)
    rows, hq, hkv, d, kv = 3, 6, 2, 8, 20
    key, value = torch.randn(rows, hkv, kv, d), torch.randn(rows, hkv, kv, d)
    for q in (1, 5):
        query = torch.randn(rows, hq, q, d)
        visible = torch.arange(kv).view(1, -1) <= torch.arange(kv - q, kv).view(-1, 1)
        causal = torch.zeros(q, kv).masked_fill(~visible, float("-inf"))
        bias = torch.randn(rows, hkv, 1, kv)  # each KV head its own logit bias
        for mask in (causal.expand(rows, 1, q, kv), causal + bias):
            expected = F.scaled_dot_product_attention(
                query,
                key.repeat_interleave(hq // hkv, dim=1),
                value.repeat_interleave(hq // hkv, dim=1),
                attn_mask=mask.repeat_interleave(hq // hkv, dim=1) if mask.shape[1] > 1 else mask,
            )
            got = masked_sdpa(query, key, value, mask)  # [B, q, Hq, D]
            assert torch.allclose(got.transpose(1, 2), expected, atol=1e-5), (q, mask.shape)
