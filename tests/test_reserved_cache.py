"""Prefill caches that append in place into reserved buffers."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ragsnap.runtime.reserved_cache import reserved


def chunks(*lengths: int, heads: int = 2, dim: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim + 1)) for n in lengths]


def plain_cache(layers: int = 2) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [DynamicLayer() for _ in range(layers)]
    return cache


def appended(cache: DynamicCache, parts) -> None:
    for keys, values in parts:
        for i in range(len(cache.layers)):
            cache.layers[i].update(keys, values)


def test_appends_in_place_equal_concatenation_and_leave_plain_layers() -> None:
    parts = chunks(5, 3, 1, 1)
    expected, cache = plain_cache(), plain_cache()
    appended(expected, parts)
    with reserved(cache, 10):
        appended(cache, parts[:1])
        first = cache.layers[0].keys.data_ptr()
        appended(cache, parts[1:])
        assert cache.layers[0].keys.data_ptr() == first  # no copy while within capacity
    for got, want in zip(cache.layers, expected.layers, strict=True):
        assert type(got) is DynamicLayer
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    # outside the block an append copies: a cache derived before it is unchanged
    before = cache.layers[0].keys.clone()
    view = cache.layers[0].keys
    cache.layers[0].update(*chunks(2)[0])
    assert torch.equal(view, before) and cache.layers[0].keys.shape[2] == 12


def test_loaded_entries_are_copied_never_written_and_capacity_grows() -> None:
    prefix_k, prefix_v = chunks(6)[0]
    kept_k, kept_v = prefix_k.clone(), prefix_v.clone()
    cache = plain_cache(1)
    layer = cache.layers[0]
    layer.lazy_initialization(prefix_k, prefix_v)
    layer.keys, layer.values = prefix_k[:, :, :4], prefix_v[:, :, :4]  # a cut-back view
    parts = chunks(3, 2)  # 9 entries in a reservation of 7: the buffer grows
    with reserved(cache, 7):
        appended(cache, parts)
        cache.crop(-1)  # a drafted token rolled back
        appended(cache, chunks(1))
    assert torch.equal(prefix_k, kept_k) and torch.equal(prefix_v, kept_v)
    keys = cache.layers[0].keys
    assert keys.shape[2] == 9
    assert torch.equal(keys[:, :, :4], kept_k[:, :, :4])
    assert torch.equal(keys[:, :, 4:7], parts[0][0]) and torch.equal(
        keys[:, :, 7:8], parts[1][0][:, :, :1]
    )
