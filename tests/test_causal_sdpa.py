"""Causal prefill chunks attend without their hidden half, to the same result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragsnap.runtime.causal_sdpa import causal_chunk_sdpa, causal_offset


def chunk_mask(q: int, keys: int) -> torch.Tensor:
    return torch.ones(q, keys, dtype=torch.bool).tril(keys - q)[None, None]


@pytest.mark.parametrize(
    ("q", "past", "heads", "kv_heads"), [(7, 0, 4, 2), (5, 9, 4, 2), (16, 40, 3, 3), (1, 3, 6, 2)]
)
def test_a_causal_chunk_attends_as_the_masked_kernel_does(q, past, heads, kv_heads) -> None:
    gen = torch.Generator().manual_seed(q + past)
    query = torch.randn(1, heads, q, 16, generator=gen)
    key, value = (torch.randn(1, kv_heads, past + q, 16, generator=gen) for _ in range(2))
    masked = F.scaled_dot_product_attention(
        query, key, value, attn_mask=chunk_mask(q, past + q), scale=0.3, enable_gqa=True
    )
    split = causal_chunk_sdpa(query, key, value, past, scaling=0.3)
    assert split.shape == masked.shape
    assert torch.allclose(split, masked, atol=1e-5)


def test_only_a_plain_causal_chunk_of_one_prompt_is_recognized() -> None:
    assert causal_offset(chunk_mask(4, 10), 10) == 6
    additive = torch.zeros(1, 1, 4, 10).masked_fill(~chunk_mask(4, 10), float("-inf"))
    assert causal_offset(additive, 10) == 6
    lowest = torch.zeros(1, 1, 4, 12).masked_fill(
        ~chunk_mask(4, 12), torch.finfo(torch.float32).min
    )
    assert causal_offset(lowest[..., :12], 12) == 8
    wide = torch.cat([chunk_mask(4, 10), torch.zeros(1, 1, 4, 2, dtype=torch.bool)], -1)
    assert causal_offset(wide, 10) == 6  # a mask wider than the keys: its first 10 columns
    padded = chunk_mask(4, 10).clone()
    padded[..., 0] = False  # a left-padded row
    assert causal_offset(padded, 10) is None
    assert causal_offset(chunk_mask(4, 10).expand(2, 1, 4, 10), 10) is None  # two rows
    biased = additive.clone()
    biased[..., 3] = -0.5  # a finite bias on a visible key
    assert causal_offset(biased, 10) is None
    window = chunk_mask(4, 10) & ~torch.ones(4, 10, dtype=torch.bool).tril(2)[None, None]
    assert causal_offset(window, 10) is None  # a sliding window hides old keys
    assert causal_offset(chunk_mask(4, 10), 3) is None  # fewer keys than queries


def test_the_check_is_made_once_per_mask_and_key_count(monkeypatch) -> None:
    import ragsnap.runtime.causal_sdpa as module

    calls = []
    real = module._causal_offset
    monkeypatch.setattr(module, "_causal_offset", lambda m, k: calls.append(k) or real(m, k))
    mask = chunk_mask(3, 8)
    assert [causal_offset(mask, 8) for _ in range(5)] == [5] * 5
    assert causal_offset(mask, 7) is None  # 8 keys' mask, cut to 7: not causal
    assert causal_offset(chunk_mask(3, 8), 8) == 5  # another tensor, checked anew
    assert calls == [8, 7, 8]


def test_a_chunked_prefill_takes_the_causal_path_to_the_same_logits(monkeypatch) -> None:
    import ragsnap.runtime.attention as attention
    from ragsnap.compression import make_press
    from tests.tiny_models import random_prompt, tiny_engine

    runtime = tiny_engine("llama").runtime
    runtime.chunk = 16
    # the module tree's attention computes every chunk (the lean pass's: test_llama_pass)
    monkeypatch.setattr("ragsnap.runtime.prefill.chunk_pass", lambda model: None)
    prompt, press = random_prompt(70, seed=3), make_press("snapkv", budget=24, window=8)
    taken = []
    real = attention.causal_chunk_sdpa
    monkeypatch.setattr(
        attention, "causal_chunk_sdpa", lambda *a, **k: taken.append(a[3]) or real(*a, **k)
    )
    split = runtime.prefill(prompt, press)
    # the chunks after 16 and 32 cached tokens (the first has no mask: sdpa's is_causal)
    assert {16, 32} <= set(taken)
    monkeypatch.setattr(attention, "causal_offset", lambda mask, keys: None)
    taken.clear()
    masked = runtime.prefill(prompt, press)
    assert not taken
    assert torch.allclose(split.next_logits, masked.next_logits, atol=1e-5)
    for a, b in zip(split.kept, masked.kept, strict=True):
        assert torch.equal(a.indices, b.indices)
