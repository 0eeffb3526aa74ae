"""Attention Matching: the fits recover the full attention where an exact answer exists,
refitting a full budget is the identity, and a zero bias decodes exactly like plain sdpa."""

from __future__ import annotations

import torch

from ragsnap.compression import make_press
from ragsnap.compression.attention_matching import (
    AttentionMatchingPress,
    fit_mass_weights,
    refit_values,
)
from ragsnap.compression.base import CompressedLayer, LayerContext, Press
from ragsnap.runtime.attention import masked_sdpa
from tests.tiny_models import random_prompt, tiny_engine


def test_mass_fit_recovers_multiplicities_of_duplicated_keys() -> None:
    torch.manual_seed(0)
    kept = torch.rand(2, 3, 16, 5) + 0.1  # [B, H, Q, n]: exp-logits of 5 kept keys
    multiplicity = torch.tensor([1.0, 3.0, 2.0, 1.0, 4.0])
    target = kept @ multiplicity  # every dropped key is a copy of a kept one
    weights = fit_mass_weights(kept, target, iterations=2000)
    assert torch.allclose(weights, multiplicity.expand_as(weights), rtol=2e-2)
    assert (weights >= 0).all()
    # no kept key of the prefix (every kept entry is in the window): nothing to fit
    assert fit_mass_weights(kept[..., :0], target, iterations=3).shape == (2, 3, 0)


def test_value_refit_reaches_an_achievable_output() -> None:
    torch.manual_seed(1)
    weights = torch.rand(3, 4, 8).softmax(-1)  # [H, Q, n], fewer queries than keys
    start, truth = torch.randn(3, 8, 6), torch.randn(3, 8, 6)
    residual = weights @ truth - weights @ start
    refit = refit_values(weights, start, residual, ridge=1e-6)
    assert torch.allclose(weights @ refit, weights @ truth, atol=1e-3)
    # the prior: with a huge ridge the values barely move
    assert torch.allclose(refit_values(weights, start, residual, ridge=1e6), start, atol=1e-4)


class _Keep(Press):
    """Keeps given prefix positions plus the window (for synthetic problems)."""

    name = "fixed"

    def __init__(self, prefix: list[int], window: int, exact: tuple[int, ...] = ()) -> None:
        self.prefix, self.window, self.exact = prefix, window, exact

    def compress(self, layer: LayerContext) -> CompressedLayer:
        positions = self.prefix + list(range(layer.seq_len - self.window, layer.seq_len))
        indices = torch.tensor(positions).expand(1, layer.num_kv_heads, -1)
        kept = CompressedLayer.gather(layer.keys, layer.values, indices)
        if self.exact:
            kept.exact = torch.isin(indices, torch.tensor(self.exact))
        return kept


def _synthetic_layer(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor
) -> LayerContext:
    """A LayerContext whose window queries are given (memoized), with no model behind it."""

    class Module(torch.nn.Module):
        class config:  # noqa: N801 - mimics a transformers config
            num_attention_heads = queries.shape[1]

        scaling = 1.0

    window = queries.shape[2]
    layer = LayerContext(
        layer_idx=0,
        num_layers=1,
        module=Module(),
        keys=keys,
        values=values,
        hidden_states=torch.zeros(1, window, 4),
        position_embeddings=(torch.zeros(1), torch.zeros(1)),
    )
    layer._memo[f"queries:{window}"] = queries
    return layer


def _attention(queries, keys, values, bias=None):
    """Causal-window attention output for the last w queries, per query head: [1, Hq, w, D]."""
    group = queries.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    logits = queries @ k.transpose(-1, -2)
    if bias is not None:
        logits[..., : bias.shape[-1]] += bias.repeat_interleave(group, 1).unsqueeze(2)
    w, n = queries.shape[2], keys.shape[2]
    logits[..., n - w :] += torch.full((w, w), float("-inf")).triu(1)
    return logits.softmax(-1) @ v


def test_dropping_duplicate_keys_is_undone_exactly() -> None:
    torch.manual_seed(2)
    distinct_k, distinct_v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    # prefix of 10 = the 4 distinct entries repeated; window of 3 fresh entries
    order = [0, 1, 2, 3, 0, 1, 2, 0, 1, 0]
    window_k, window_v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    keys = torch.cat([distinct_k[:, :, order], window_k], 2)
    values = torch.cat([distinct_v[:, :, order], window_v], 2)
    queries = torch.randn(1, 2, 3, 8)  # two query heads share the KV head
    layer = _synthetic_layer(keys, values, queries)
    press = AttentionMatchingPress(base=_Keep([0, 1, 2, 3], window=3), mass_iterations=3000)
    press.base.window = 3
    out = press.compress(layer)
    assert out.bias is not None
    assert torch.allclose(out.bias[0, 0, :4].exp(), torch.tensor([4.0, 3.0, 2.0, 1.0]), rtol=2e-2)
    assert torch.equal(out.bias[0, 0, 4:], torch.zeros(3))  # the window keeps no bias
    full = _attention(queries, keys, values)
    compressed = _attention(queries, out.keys, out.values, out.bias)
    assert torch.allclose(compressed, full, atol=1e-3)
    assert torch.equal(out.values[..., 4:, :], window_v)  # window values stay exact


def test_full_budget_compress_and_refit_is_the_identity() -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(48, seed=5)
    [full, refit] = engine.runtime.prefill_many(
        prompt, [make_press("full"), make_press("ragsnap", budget=64, window=8)]
    )
    assert not refit.bias
    for a, b in zip(full.kept, refit.kept, strict=True):
        assert torch.equal(a.indices, b.indices)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_refit_brings_the_reference_queries_closer_to_the_full_output() -> None:
    torch.manual_seed(4)
    keys, values = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    queries = torch.randn(1, 4, 8, 16) * 2  # 8 window queries per query head, GQA group of 2
    layer = _synthetic_layer(keys, values, queries)
    selection = _Keep(list(range(0, 56, 4)), window=8)
    plain = selection.compress(layer)
    matched = AttentionMatchingPress(base=selection).compress(layer)
    full = _attention(queries, keys, values)
    error_plain = (_attention(queries, plain.keys, plain.values) - full).norm()
    error_matched = (_attention(queries, matched.keys, matched.values, matched.bias) - full).norm()
    assert error_matched < 0.75 * error_plain
    # less regularization fits the reference queries more tightly
    loose = AttentionMatchingPress(base=selection, ridge=0.01).compress(layer)
    error_loose = (_attention(queries, loose.keys, loose.values, loose.bias) - full).norm()
    assert error_loose < error_matched


def test_entries_marked_exact_get_no_bias_and_keep_their_values() -> None:
    torch.manual_seed(5)
    keys, values = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    layer = _synthetic_layer(keys, values, torch.randn(1, 4, 8, 16) * 2)
    prefix = list(range(0, 56, 4))
    out = AttentionMatchingPress(base=_Keep(prefix, window=8, exact=(8, 12))).compress(layer)
    assert out.bias is not None and out.exact is not None
    exact = out.exact[..., : len(prefix)]
    assert exact.sum() == 4  # positions 8 and 12 in both KV heads
    assert torch.equal(out.bias[..., : len(prefix)][exact], torch.zeros(4))
    assert torch.equal(
        out.values[..., : len(prefix), :][exact], values[:, :, [8, 12]].flatten(0, 2)
    )
    free = ~exact
    assert (out.bias[..., : len(prefix)][free].abs() > 1e-3).any()
    assert not torch.allclose(out.values[..., : len(prefix), :][free], values[:, :, prefix][free])


def test_zero_bias_decodes_exactly_like_plain_sdpa() -> None:
    from ragsnap.runtime.prefill import forward_chunk

    engine = tiny_engine("llama")
    prompt = random_prompt(40, seed=7)
    result = engine.runtime.prefill(prompt, make_press("snapkv", budget=24, window=8))
    result.bias = {i: torch.zeros(1, 2, 24) for i in range(4)}
    [biased] = engine.runtime.teacher_force([result], [5])  # the runtime's masked sdpa
    plain = forward_chunk(
        engine.loaded.model, engine.loaded.cache_kwarg, [5], result.cache, len(prompt)
    )
    assert torch.allclose(plain.log_softmax(-1), biased, atol=1e-5)


def test_masked_sdpa_with_a_bias_matches_a_written_out_softmax() -> None:
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    bias = torch.randn(1, 2, 6)
    mask = torch.zeros(1, 2, 3, 10)
    mask[..., :6] += bias.unsqueeze(2)
    mask[..., 7:] += torch.full((3, 3), float("-inf")).triu(1)
    out = masked_sdpa(q, k, v, mask, scaling=1.0)
    expected = _attention(q, k, v, bias)
    assert torch.allclose(out.transpose(1, 2), expected, atol=1e-5)


def test_wrapping_presses_expose_the_window_a_prefix_hit_must_recompute() -> None:
    from ragsnap.runtime.prefill import window_floor

    for name in ("attnmatch", "ragsnap", "wordspan", "snapkv"):
        assert window_floor(make_press(name, budget=64, window=8)) == 8
    assert AttentionMatchingPress(base=make_press("full")).window == 0
