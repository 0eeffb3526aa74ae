"""SnapKV against a deliberately simple reference of GUIDE section 2, written separately.

The reference captures each attention layer's input itself (a hook on the decoder layer's
``input_layernorm``), projects the queries with ``q_proj`` (+ ``q_norm``), applies RoPE with
its own rotate-half formula, and scores with explicit loops: per KV head, per query head of
the group, per window query, a float32 softmax over the keys that query may see. Keys come
from a plain forward without any ragsnap hook. ragsnap's kept indices must match.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from ragsnap.compression import SnapKVPress, compression_hooks
from tests.tiny_models import (
    ARCHITECTURES,
    GEMMA3_SLIDING_WINDOW,
    KV_HEADS,
    random_prompt,
    tiny_engine,
    tiny_model,
)

PROMPT_LEN = 96
# (window, budget): small and large windows, budgets close to the window and generous
SETTINGS = [(4, 24), (8, 40), (16, 32), (16, 72)]
KERNELS = {"max": 5, "avg": 3}


# -- the reference -----------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _rope_tables(model, hidden: torch.Tensor, layer_idx: int):
    """(cos, sin) ``[1, L, D]`` the model uses at ``layer_idx`` for positions 0..L-1."""
    inner = model.model
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    layer_types = getattr(inner.config, "layer_types", None)
    if hasattr(inner.rotary_emb, "layer_types") and layer_types is not None:  # Gemma3
        return inner.rotary_emb(hidden, positions, layer_types[layer_idx])
    return inner.rotary_emb(hidden, positions)


def softmax_scale(model) -> float:
    config = model.config
    if getattr(config, "query_pre_attn_scalar", None):  # Gemma
        return config.query_pre_attn_scalar**-0.5
    return config.head_dim**-0.5


def reference_run(model, input_ids: list[int]):
    """Plain forward, capturing attention inputs: (``{layer: [1, L, hidden]}``, cache)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for idx, layer in enumerate(model.model.layers):

        def grab(_module, _args, output, idx=idx):
            captured[idx] = output.detach()

        handles.append(layer.input_layernorm.register_forward_hook(grab))
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([input_ids]), cache=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    return captured, cache


def reference_window_queries(model, layer_idx: int, hidden: torch.Tensor, window: int):
    """``[Hq, w, D]`` float32 queries of the last ``window`` positions, RoPE applied."""
    attn = model.model.layers[layer_idx].self_attn
    config = model.config
    length = hidden.shape[1]
    with torch.no_grad():
        q = attn.q_proj(hidden).view(1, length, config.num_attention_heads, config.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        q = q[0].transpose(0, 1)  # [Hq, L, D]
        cos, sin = _rope_tables(model, hidden, layer_idx)
        q = q * cos[0] + _rotate_half(q) * sin[0]
    return q[:, length - window :].float()


def reference_snapkv(queries, keys, window: int, budget: int, kernel: int, pooling: str, scale):
    """Reference scores ``[Hkv, L - w]`` for one layer, with loops (``keys``: ``[Hkv, L, D]``)."""
    hq, length = queries.shape[0], keys.shape[1]
    group = hq // keys.shape[0]
    prefix = length - window
    scores = torch.zeros(keys.shape[0], prefix)
    for kv_head in range(keys.shape[0]):
        k = keys[kv_head].float()
        for g in range(group):
            q_head = kv_head * group + g
            for i in range(window):
                visible = prefix + i + 1  # query at position prefix + i sees keys 0..prefix+i
                logits = (k[:visible] @ queries[q_head, i]) * scale
                probs = torch.softmax(logits.float(), dim=0)
                scores[kv_head] += probs[:prefix] / group
    pooled = torch.empty_like(scores)
    half = kernel // 2
    for kv_head in range(scores.shape[0]):
        for j in range(prefix):
            lo, hi = max(0, j - half), min(prefix, j + half + 1)
            neighbourhood = scores[kv_head, lo:hi]
            # zero padding at the edges, as a padded average pool counts it
            pooled[kv_head, j] = (
                neighbourhood.max() if pooling == "max" else neighbourhood.sum() / kernel
            )
    return pooled


def assert_same_selection(kept: torch.Tensor, ref_scores: torch.Tensor, window: int, budget: int):
    """``kept`` (``[Hkv, n]``) equals the reference's top ``budget - window`` + window.

    Positions whose reference score ties the cut-off (within float noise) may go either way,
    as any top-k may order equal scores differently; everything strictly above must be kept
    and nothing strictly below may be. Returns how many heads matched exactly.
    """
    prefix = ref_scores.shape[-1]
    length = prefix + window
    exact = 0
    for head in range(kept.shape[0]):
        indices = kept[head]
        assert torch.equal(indices, indices.sort().values), (
            "kept indices are not in positional order"
        )
        assert indices.shape[0] == budget
        assert indices[-window:].tolist() == list(range(prefix, length)), "the window was not kept"
        chosen = set(indices[:-window].tolist())
        scores = ref_scores[head]
        cutoff = scores.topk(budget - window).values[-1]
        tol = 1e-5 * float(scores.max())
        above = {j for j in range(prefix) if scores[j] > cutoff + tol}
        tied = {j for j in range(prefix) if abs(scores[j] - cutoff) <= tol}
        assert above <= chosen, f"head {head}: missed {sorted(above - chosen)}"
        assert chosen <= above | tied, (
            f"head {head}: kept low scorers {sorted(chosen - above - tied)}"
        )
        ref_top = set(scores.topk(budget - window).indices.tolist())
        exact += chosen == ref_top
    return exact


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_snapkv_matches_reference(arch: str, attn: str) -> None:
    model = tiny_model(arch, attn)
    input_ids = random_prompt(PROMPT_LEN, seed=1)
    hidden, plain_cache = reference_run(model, input_ids)

    presses, cases = [], []
    for window, budget in SETTINGS:
        for pooling, kernel in KERNELS.items():
            presses.append(
                SnapKVPress(budget=budget, window=window, kernel=kernel, pooling=pooling)
            )
            cases.append((window, budget, kernel, pooling))
    cache = DynamicCache(config=model.config)
    with compression_hooks(model, presses, apply=False) as recorder, torch.no_grad():
        recorder.armed = True
        model(input_ids=torch.tensor([input_ids]), cache=cache, use_cache=True)

    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * 4
    full_layers = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    sliding_layers = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    assert recorder.skipped_layers == set(sliding_layers)
    if arch == "gemma3":
        assert sliding_layers and full_layers
        for i in sliding_layers:  # sliding layers really slid and were left alone
            assert cache.layers[i].keys.shape[-2] == GEMMA3_SLIDING_WINDOW - 1 < PROMPT_LEN

    exact = total = 0
    scale = softmax_scale(model)
    for p, (window, budget, kernel, pooling) in enumerate(cases):
        assert sorted(recorder.results[p]) == full_layers
        for layer_idx in full_layers:
            keys = plain_cache.layers[layer_idx].keys[0]
            assert keys.shape[-2] == PROMPT_LEN
            queries = reference_window_queries(model, layer_idx, hidden[layer_idx], window)
            ref = reference_snapkv(queries, keys, window, budget, kernel, pooling, scale)
            kept = recorder.results[p][layer_idx].indices[0]
            exact += assert_same_selection(kept, ref, window, budget)
            total += KV_HEADS
    # ties at the cut-off are allowed, but they must stay the exception
    assert exact >= 0.8 * total, f"only {exact}/{total} heads matched the reference exactly"


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_engine_prefill_applies_reference_selection(arch: str) -> None:
    """Through ``RagSnapEngine.prefill``: kept indices match the reference and the cache
    holds exactly the kept entries of the full-cache keys and values."""
    engine = tiny_engine(arch, "sdpa")
    model = engine.loaded.model
    input_ids = random_prompt(PROMPT_LEN, seed=2)
    window, budget, kernel = 8, 40, 7
    press = SnapKVPress(budget=budget, window=window, kernel=kernel, pooling="max")
    result = engine.runtime.prefill(input_ids, press)
    hidden, plain_cache = reference_run(model, input_ids)
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * 4
    full_layers = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    assert len(result.kept) == len(full_layers)
    assert result.original_length == PROMPT_LEN
    for kept, layer_idx in zip(result.kept, full_layers, strict=True):
        queries = reference_window_queries(model, layer_idx, hidden[layer_idx], window)
        full_keys = plain_cache.layers[layer_idx].keys[0]
        ref = reference_snapkv(
            queries, full_keys, window, budget, kernel, "max", softmax_scale(model)
        )
        assert_same_selection(kept.indices[0], ref, window, budget)
        stored = result.cache.layers[layer_idx]
        idx = kept.indices[0]  # [Hkv, n]
        for head in range(KV_HEADS):
            torch.testing.assert_close(stored.keys[0, head], full_keys[head, idx[head]])
            full_values = plain_cache.layers[layer_idx].values[0, head]
            torch.testing.assert_close(stored.values[0, head], full_values[idx[head]])
    for layer_idx, kind in enumerate(layer_types):
        expected = budget if kind == "full_attention" else GEMMA3_SLIDING_WINDOW - 1
        assert result.cache.layers[layer_idx].keys.shape == (1, KV_HEADS, expected, 16)
    assert math.isclose(result.keep_rate().mean().item(), budget / PROMPT_LEN, rel_tol=1e-6)
