"""Serialization of cache entries and their keys: bit-identical round trips, stale entries."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from ragsnap.cache import keys
from ragsnap.cache.backends.store import namespace_label
from ragsnap.cache.serialization import (
    FORMAT_VERSION,
    StaleEntry,
    deserialize_prefill,
    deserialize_prefix,
    read_metadata,
    serialize_prefill,
    serialize_prefix,
)
from ragsnap.compression import CompressedLayer

MODEL = {"model_id": "tiny", "revision": "r1"}


def _entry(length: int = 50, kept: int = 12, layers: int = 3, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    cache_layers, compressed = [], []
    for i in range(layers):
        idx = torch.stack(
            [
                torch.randperm(50, generator=gen)[:kept].sort().values for _ in range(2)
            ]  # + length - 50 below: inside the prompt
        )
        k = torch.randn(1, 2, kept, 8, generator=gen).to(dtype)
        v = torch.randn(1, 2, kept, 8, generator=gen).to(dtype)
        cache_layers.append((k, v))
        bias = torch.randn(1, 2, kept, generator=gen) if i == 1 else None
        layer = CompressedLayer(
            indices=idx.unsqueeze(0) + (length - 50), keys=k, values=v, bias=bias
        )
        if i == 2:  # kept entries that are not the cache's own tensors travel separately
            layer = CompressedLayer(indices=layer.indices, keys=k.clone() + 1, values=v.clone())
        compressed.append(layer)
    logits = torch.randn(1, 100, generator=gen)
    return cache_layers, compressed, logits


def _serialize(length: int = 50, storage_dtype=None, **kwargs):
    layers, kept, logits = _entry(length, **kwargs)
    payload = serialize_prefill(
        layers,
        kept,
        logits,
        original_length=length,
        press_config={"press": "snapkv", "budget": 12},
        kv_bytes_full=1234,
        storage_dtype=storage_dtype,
        decode_bias={1: torch.full((1, 2, 12), 0.5)},
        draft=[7, 0, 99],
        **MODEL,
    )
    return payload, layers, kept, logits


@pytest.mark.parametrize("length", [50, 40_000])  # int16 and int32 positions on disk
def test_compressed_round_trip_is_bit_identical(length):
    payload, layers, kept, logits = _serialize(length)
    stored = deserialize_prefill(payload, **MODEL)
    assert stored.original_length == length and stored.kv_bytes_full == 1234
    assert stored.press_config == {"press": "snapkv", "budget": 12}
    assert torch.equal(stored.next_logits, logits)
    for (k, v), (k2, v2) in zip(layers, stored.layers, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2) and k2.dtype == k.dtype
    for a, b in zip(kept, stored.kept, strict=True):
        assert b.indices.dtype == torch.long and torch.equal(a.indices, b.indices)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert (a.bias is None and b.bias is None) or torch.equal(a.bias, b.bias)
    assert stored.kept[0].keys is stored.layers[0][0]  # shared, not stored twice
    assert torch.equal(stored.decode_bias[1], torch.full((1, 2, 12), 0.5))
    assert stored.draft == [7, 0, 99]
    assert read_metadata(payload)["format_version"] == FORMAT_VERSION


def test_a_decode_bias_shared_with_the_kept_bias_is_stored_once():
    layers, kept, logits = _entry()
    shared = {1: kept[1].bias}  # what the recorder hands the engine: the same tensor
    payload = serialize_prefill(
        layers,
        kept,
        logits,
        original_length=50,
        press_config={},
        kv_bytes_full=0,
        decode_bias=shared,
        **MODEL,
    )
    stored = deserialize_prefill(payload, **MODEL)
    assert torch.equal(stored.decode_bias[1], kept[1].bias)
    assert stored.decode_bias[1] is stored.kept[1].bias
    assert "dbias.1" not in load(payload)


def test_storage_dtype_halves_the_bytes_and_loads_back_in_the_model_dtype():
    full, layers, _, _ = _serialize()
    half, _, _, _ = _serialize(storage_dtype=torch.bfloat16)
    stored = deserialize_prefill(half, **MODEL)
    k, k2 = layers[0][0], stored.layers[0][0]
    assert k2.dtype == torch.float32 and not torch.equal(k, k2)
    assert torch.equal(k2, k.to(torch.bfloat16).float())
    assert (k - k2).abs().max() <= k.abs().max() * 2**-8
    assert len(half) < 0.75 * len(full)


def test_stale_version_wrong_model_and_garbage_are_stale_entries():
    payload, *_ = _serialize()
    tensors, meta = load(payload), read_metadata(payload)
    old = save(tensors, metadata={**meta, "format_version": "0"})
    with pytest.raises(StaleEntry, match="format version"):
        deserialize_prefill(old, **MODEL)
    with pytest.raises(StaleEntry, match="another model"):
        deserialize_prefill(payload, model_id="tiny", revision="r2")
    with pytest.raises(StaleEntry):
        deserialize_prefill(b"\x00" * 3, **MODEL)
    with pytest.raises(StaleEntry):
        deserialize_prefill(b"\xff" * 64, **MODEL)
    prefix = serialize_prefix(
        [(torch.ones(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))], prefix_len=5, **MODEL
    )
    with pytest.raises(StaleEntry, match="kind"):
        deserialize_prefill(prefix, **MODEL)
    # drafted tokens the model has no embedding for would fail the decode batch
    for draft in ("[100]", "[-1]", "[1.5]", '{"a": 1}', '["7"]'):
        with pytest.raises(StaleEntry, match="vocabulary"):
            deserialize_prefill(save(tensors, metadata={**meta, "draft": draft}), **MODEL)
    without = {k: v for k, v in meta.items() if k != "draft"}  # written before drafts
    assert deserialize_prefill(save(tensors, metadata=without), **MODEL).draft == []


def test_prefix_round_trip_and_length_check():
    layers = [(torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)) for _ in range(2)]
    payload = serialize_prefix(layers, prefix_len=7, **MODEL)
    back = deserialize_prefix(payload, prefix_len=7, **MODEL)
    assert all(
        torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(layers, back, strict=True)
    )
    with pytest.raises(StaleEntry, match="prefix of 7"):
        deserialize_prefix(payload, prefix_len=8, **MODEL)
    assert json.loads(read_metadata(payload)["num_layers"]) == 2


def _ckey(**over):
    fields = dict(
        model=keys.model_identity("m", "r", "float32", "cpu"),
        template_version="t1",
        press_config={"press": "snapkv", "budget": 64},
        doc_hashes=["a", "b"],
        question="What is X?",
        prompt_ids=[1, 2, 3],
    )
    fields.update(over)
    return keys.compressed_key("ns", **fields)


def test_keys_depend_on_every_part_and_on_document_order():
    base = _ckey()
    assert _ckey().digest == base.digest
    assert _ckey(question="  What   is X? ").digest == base.digest  # normalized
    for change in (
        {"question": "What is Y?"},
        {"doc_hashes": ["b", "a"]},
        {"press_config": {"press": "snapkv", "budget": 65}},
        {"template_version": "t2"},
        {"model": keys.model_identity("m", "r2", "float32", "cpu")},
        {"prompt_ids": [1, 2, 4]},
        {"storage_dtype": "bfloat16"},
    ):
        assert _ckey(**change).digest != base.digest, change
    prefix = keys.prefix_key(
        "ns",
        model=keys.model_identity("m", "r", "float32", "cpu"),
        template_version="t1",
        doc_hashes=["a", "b"],
        prefix_ids=[1, 2],
    )
    assert prefix.kind == "prefix" and prefix.digest != base.digest
    assert keys.compressed_key(None, **{k: v for k, v in _fields().items()}).namespace == "default"


def _fields():
    return dict(
        model=keys.model_identity("m", "r", "float32", "cpu"),
        template_version="t1",
        press_config={},
        doc_hashes=[],
        question="q",
        prompt_ids=[1],
    )


def test_namespace_labels_are_plain_or_hashed():
    assert namespace_label("tenant-1") == "tenant-1"
    assert namespace_label(None) == "default"
    odd = namespace_label("sk-abc:*/..")
    assert odd.startswith("h-") and ":" not in odd and "*" not in odd
    assert namespace_label("..") != ".."
