"""int8 cache entries (issue 42): a quarter of float32's bytes, every value within half a
scale step of the original, the scales checked on load, and the engine's hits computed on
what the store gives back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save

from ragsnap.cache import int8_kv
from ragsnap.cache.serialization import (
    StaleEntry,
    deserialize_prefill,
    deserialize_prefix,
    parse_dtype,
    read_metadata,
    serialize_prefix,
)
from tests.test_cache_serialization import MODEL, _serialize


def test_quantize_keeps_each_value_within_half_a_step_of_its_own_vector():
    x = torch.randn(1, 2, 7, 16) * torch.logspace(-3, 3, 7).view(1, 1, 7, 1)  # outlier tokens
    x[0, 0, 3] = 0  # an all-zero vector
    q, scale = int8_kv.quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (1, 2, 7, 1)
    back = int8_kv.dequantize(q, scale, torch.float32)
    assert bool(((back - x).abs() <= scale / 2 + 1e-12).all())
    assert torch.equal(back[0, 0, 3], torch.zeros(16))


def test_an_int8_compressed_entry_round_trips_close_at_a_third_of_the_bytes():
    exact = _serialize(storage_dtype=None)[0]
    small, layers, kept, _ = _serialize(storage_dtype=torch.int8)
    assert read_metadata(small)["storage_dtype"] == "int8"
    stored = deserialize_prefill(small, **MODEL, dtype=torch.float32)
    for (k, v), (k2, v2) in zip(layers, stored.layers, strict=True):
        assert k2.dtype == torch.float32 and k2.shape == k.shape
        for a, b in ((k, k2), (v, v2)):
            step = a.abs().amax(-1, keepdim=True) / 127
            assert bool(((a - b).abs() <= step / 2 + 1e-7).all())
    assert torch.allclose(stored.kept[2].keys, kept[2].keys, atol=0.05)  # its own tensors

    def tensor_bytes(payload: bytes) -> int:
        return sum(t.nbytes for t in load(payload).values())

    def kv(payload: bytes) -> int:
        return sum(t.nbytes for n, t in load(payload).items() if n[:2] in ("k.", "v.", "kk", "kv"))

    assert kv(small) < 0.45 * kv(exact) and tensor_bytes(small) < tensor_bytes(exact)


def test_int8_prefix_entries_and_missing_or_bad_scales():
    layers = [(torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)) for _ in range(2)]
    payload = serialize_prefix(layers, prefix_len=9, **MODEL, storage_dtype=torch.int8)
    back = deserialize_prefix(payload, **MODEL, prefix_len=9, dtype=torch.float32)
    assert all(torch.allclose(a, b, atol=0.05) for (a, _), (b, _) in zip(layers, back, strict=True))
    tensors, meta = load(payload), read_metadata(payload)
    for damage in ("drop", "shape", "nan"):
        broken = dict(tensors)
        if damage == "drop":
            del broken["v.1.scale"]
        elif damage == "shape":
            broken["v.1.scale"] = broken["v.1.scale"][:, :, :3].contiguous()
        else:
            broken["v.1.scale"] = torch.full_like(broken["v.1.scale"], float("nan"))
        with pytest.raises(StaleEntry, match="int8 scales"):
            deserialize_prefix(save(broken, metadata=meta), **MODEL, prefix_len=9)


def test_int8_is_a_storage_dtype_and_int32_is_not():
    assert parse_dtype("int8") == torch.int8
    with pytest.raises(ValueError, match="int32"):
        parse_dtype("int32")
