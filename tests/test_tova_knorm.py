"""TOVA and key-norm against hand-computed references; keeping the instruction whatever the press."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.compression.base import LayerContext
from ragsnap.compression.roles import TokenRole
from tests.tiny_models import random_prompt, tiny_engine


class _Attention(torch.nn.Module):
    """An attention module whose queries are its input (identity q_proj, no RoPE)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = torch.nn.Identity()
        self.head_dim = head_dim
        self.scaling = 1.0
        self.config = SimpleNamespace(num_attention_heads=heads)


def _layer(keys: torch.Tensor, last_query: torch.Tensor) -> LayerContext:
    """keys ``[1, Hkv, L, D]``; the last prompt position's queries ``[Hq, D]``."""
    heads, dim = last_query.shape
    hidden = last_query.reshape(1, 1, heads * dim)
    cos, sin = torch.ones(1, 1, dim), torch.zeros(1, 1, dim)  # RoPE at angle 0: identity
    return LayerContext(
        layer_idx=0,
        num_layers=1,
        module=_Attention(heads, dim),
        keys=keys,
        values=torch.randn_like(keys),
        hidden_states=hidden,
        position_embeddings=(cos, sin),
    )


def test_tova_keeps_what_the_last_query_attends_to_averaged_over_all_heads() -> None:
    # KV head 0 keys [a_i, 0], head 1 keys [0, b_i]; query head 0 = [1, 0], head 1 = [0, 1]
    a = [0.0, 2.0, 0.0, 1.9, 0.0, 0.0]
    b = [3.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    keys = torch.zeros(1, 2, 6, 2)
    keys[0, 0, :, 0] = torch.tensor(a)
    keys[0, 1, :, 1] = torch.tensor(b)
    layer = _layer(keys, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    # by hand: p0 = exp(a)/sum exp(a), p1 = exp(b)/sum exp(b), TOVA score = (p0 + p1) / 2
    za, zb = sum(math.exp(x) for x in a), sum(math.exp(x) for x in b)
    by_hand = [(math.exp(x) / za + math.exp(y) / zb) / 2 for x, y in zip(a, b, strict=True)]
    press = make_press("tova", budget=3, window=1)
    scores = press.score(layer)  # type: ignore[attr-defined]
    assert scores.shape == (1, 2, 5)
    assert torch.allclose(scores[0, 0], torch.tensor(by_hand[:5]), atol=1e-6)
    assert torch.equal(scores[0, 0], scores[0, 1])  # one decision per layer
    kept = press.compress(layer).indices
    # by_hand ~ [0.428, 0.224, 0.048, 0.205, 0.048]: positions 0 and 1, then the window (5),
    # in both heads (head 0 alone would keep 1 and 3)
    assert kept.tolist() == [[[0, 1, 5], [0, 1, 5]]]


def test_knorm_keeps_the_smallest_keys_per_head() -> None:
    norms = [[3.0, 1.0, 2.0, 0.5, 4.0, 9.0], [0.1, 5.0, 5.0, 5.0, 0.2, 9.0]]
    keys = torch.zeros(1, 2, 6, 2)
    for head, row in enumerate(norms):
        keys[0, head, :, 0] = torch.tensor(row) * 0.6  # |(0.6 n, 0.8 n)| = n
        keys[0, head, :, 1] = torch.tensor(row) * 0.8
    layer = _layer(keys, torch.zeros(2, 2))
    press = make_press("knorm", budget=3, window=1)
    assert torch.allclose(press.score(layer)[0], -torch.tensor(norms)[:, :5])  # type: ignore[attr-defined]
    assert press.compress(layer).indices.tolist() == [[[1, 3, 5], [0, 4, 5]]]


@pytest.mark.parametrize("name", ["tova", "knorm"])
def test_tova_and_knorm_keep_exactly_the_budget_on_a_model(name: str) -> None:
    engine = tiny_engine("qwen3")
    [result] = engine.runtime.prefill_many(
        random_prompt(90, seed=2), [make_press(name, budget=30, window=4)]
    )
    assert result.kept_tokens_per_layer == [30] * 4
    for layer in result.kept:
        assert layer.indices[0, :, -1].eq(89).all()  # the window is kept
        assert (layer.indices.diff(dim=-1) > 0).all()  # positional order, no repeats


@pytest.mark.parametrize("name", ["snapkv", "tova", "knorm", "ragsnap", "roles"])
def test_keep_instruction_keeps_the_head_within_the_budget(name: str) -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(120, seed=4)
    roles = torch.zeros(120, dtype=torch.uint8)
    roles[:10] = TokenRole.INSTRUCTION
    roles[40:80:2] = TokenRole.VALUE  # structure, so the role press allocates
    plain = make_press(name, budget=40, window=8)
    kept_head = make_press(name, budget=40, window=8, keep_instruction=True)
    assert kept_head.config() == {**plain.config(), "keep_instruction": True}
    without, with_head = engine.runtime.prefill_many(prompt, [plain, kept_head], roles=roles)
    assert with_head.kept_tokens_per_layer == without.kept_tokens_per_layer
    missing = 0
    for a, b in zip(without.kept, with_head.kept, strict=True):
        head = b.indices[..., :10]
        assert torch.equal(head, torch.arange(10).expand_as(head))  # every layer, every head
        missing += int((a.indices < 10).sum() < 10 * a.indices.shape[1])
    assert missing > 0  # without the option some instruction tokens were dropped
