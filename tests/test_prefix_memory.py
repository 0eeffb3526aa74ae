"""The in-memory prefix tier: least recently used first out, within its byte budget."""

from __future__ import annotations

import pytest
import torch

from ragsnap.cache.tiers.prefix_memory import PrefixMemory, layers_nbytes


def layers(tokens: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, tokens, 4), fill), torch.full((1, 2, tokens, 4), fill))] * 2


def test_it_hands_back_the_same_tensors():
    memory = PrefixMemory(1 << 20)
    kept = layers(8, 1.0)
    assert memory.put("a", kept)
    got = memory.get("a")
    assert got is not None and all(g[0] is k[0] for g, k in zip(got, kept, strict=True))
    assert memory.get("b") is None
    assert memory.nbytes == layers_nbytes(kept) == 2 * 2 * 8 * 4 * 4 * 2


def test_the_least_recently_used_prefix_leaves_first():
    one = layers_nbytes(layers(8))
    memory = PrefixMemory(3 * one)
    for name in "abc":
        memory.put(name, layers(8))
    memory.get("a")  # now b is the oldest
    memory.put("d", layers(8))
    assert [memory.get(n) is not None for n in "abcd"] == [True, False, True, True]
    assert memory.nbytes == 3 * one


def test_a_prefix_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    memory = PrefixMemory(layers_nbytes(layers(8)))
    memory.put("small", layers(8))
    assert not memory.put("large", layers(64))
    assert memory.get("large") is None and memory.get("small") is not None


def test_replacing_an_entry_keeps_the_byte_count():
    memory = PrefixMemory(1 << 20)
    memory.put("a", layers(8))
    memory.put("a", layers(16))
    assert len(memory) == 1 and memory.nbytes == layers_nbytes(layers(16))
    assert memory.get("a")[0][0].shape[2] == 16


def test_a_zero_budget_keeps_nothing_and_a_negative_one_is_refused():
    memory = PrefixMemory(0)
    assert not memory.put("a", layers(1)) and memory.get("a") is None
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixMemory(-1)


def test_a_smaller_bound_evicts_the_least_recently_used_down_to_it():
    one = layers_nbytes(layers(8))
    memory = PrefixMemory(3 * one)
    for name in "abc":
        memory.put(name, layers(8))
    memory.get("a")  # b, then c, are the oldest
    memory.resize(one + one // 2)
    assert [memory.get(n) is not None for n in "abc"] == [True, False, False]
    assert memory.nbytes == one and memory.max_bytes == one + one // 2
    assert not memory.put("large", layers(16))  # over the new bound
    with pytest.raises(ValueError, match="max_bytes"):
        memory.resize(-1)
