"""The baseline presses, budgets and the compressed cache, on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from ragsnap.compression import (
    H2OPress,
    PyramidKVPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    compression_hooks,
    make_press,
)
from ragsnap.compression.full import FullPress
from ragsnap.errors import ConfigError
from ragsnap.runtime.kv import cache_nbytes
from tests.test_snapkv_reference import (
    assert_same_selection,
    reference_run,
    reference_window_queries,
    softmax_scale,
)
from tests.tiny_models import HEAD_DIM, KV_HEADS, random_prompt, tiny_engine

LENGTH = 96
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def llama():
    return tiny_engine("llama", "sdpa")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompt(LENGTH, seed=3)


def kept_indices(result) -> list[torch.Tensor]:
    """``[Hkv, n]`` kept positions per layer."""
    return [layer.indices[0] for layer in result.kept]


# -- configuration errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: make_press("no-such-press"), "press"),
        (lambda: make_press("snapkv", budget=16, window=32), "budget"),
        (lambda: SnapKVPress(budget=8, window=16), "budget"),
        (lambda: make_press("streamingllm", budget=4, window=8), "budget"),
        (lambda: make_press("snapkv", kernel=4), "kernel"),
        (lambda: make_press("snapkv", pooling="median"), "pooling"),
        (lambda: make_press("snapkv", ratio=1.5), "ratio"),
        (lambda: make_press("snapkv", window=0), "window"),
        (lambda: make_press("streamingllm", kernel=5), "kernel"),
    ],
)
def test_bad_press_config_raises_config_error_naming_the_field(build, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.field == field
    assert str(info.value)


# -- selection of each press -------------------------------------------------------------


def test_streamingllm_keeps_sinks_and_recent(llama, prompt) -> None:
    budget, window, sinks = 24, 8, 4
    result = llama.runtime.prefill(
        prompt, StreamingLLMPress(budget=budget, window=window, sinks=sinks)
    )
    expected = list(range(sinks)) + list(range(LENGTH - (budget - sinks), LENGTH))
    assert len(result.kept) == NUM_LAYERS
    for indices in kept_indices(result):
        for head in indices:
            assert head.tolist() == expected


def test_pyramidkv_budgets_shrink_with_depth_and_keep_the_uniform_total(llama, prompt) -> None:
    budget, window = 40, 8
    result = llama.runtime.prefill(prompt, PyramidKVPress(budget=budget, window=window, kernel=5))
    per_layer = result.kept_tokens_per_layer
    assert len(per_layer) == NUM_LAYERS
    assert all(a > b for a, b in zip(per_layer, per_layer[1:], strict=False)), per_layer
    assert per_layer[-1] >= window
    assert sum(per_layer) == NUM_LAYERS * budget
    for layer_idx, layer in enumerate(result.cache.layers):
        assert layer.keys.shape == (1, KV_HEADS, per_layer[layer_idx], HEAD_DIM)


def test_pyramidkv_falls_back_to_uniform_on_short_prompts(llama) -> None:
    short = random_prompt(48, seed=4)  # too short for the pyramid's widest layer
    result = llama.runtime.prefill(short, PyramidKVPress(budget=40, window=8, kernel=5))
    assert result.kept_tokens_per_layer == [40] * NUM_LAYERS


def reference_h2o(queries: torch.Tensor, keys: torch.Tensor, window: int, scale: float):
    """Accumulated causal attention of all prompt queries, mean per KV group: ``[Hkv, L - w]``."""
    hq, length = queries.shape[0], keys.shape[1]
    group = hq // keys.shape[0]
    scores = torch.zeros(keys.shape[0], length)
    for kv_head in range(keys.shape[0]):
        for g in range(group):
            for pos in range(length):
                logits = (
                    keys[kv_head, : pos + 1].float() @ queries[kv_head * group + g, pos] * scale
                )
                scores[kv_head, : pos + 1] += torch.softmax(logits, dim=0) / group
    return scores[:, : length - window]


def test_h2o_matches_reference(llama, prompt) -> None:
    budget, window = 32, 8
    press = H2OPress(budget=budget, window=window, chunk=20)  # chunks that do not divide L
    result = llama.runtime.prefill(prompt, press)
    hidden, plain = reference_run(llama.loaded.model, prompt)
    scale = softmax_scale(llama.loaded.model)
    for layer_idx, indices in enumerate(kept_indices(result)):
        queries = reference_window_queries(llama.loaded.model, layer_idx, hidden[layer_idx], LENGTH)
        ref = reference_h2o(queries, plain.layers[layer_idx].keys[0], window, scale)
        assert_same_selection(indices, ref, window, budget)


def test_random_press_is_deterministic_per_seed(llama, prompt) -> None:
    first = kept_indices(llama.runtime.prefill(prompt, RandomPress(budget=24, window=8, seed=7)))
    again = kept_indices(llama.runtime.prefill(prompt, RandomPress(budget=24, window=8, seed=7)))
    other = kept_indices(llama.runtime.prefill(prompt, RandomPress(budget=24, window=8, seed=8)))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert not torch.equal(first[0], first[1])  # layers draw differently


def test_ratio_budget(llama, prompt) -> None:
    press = make_press("snapkv", ratio=0.25, window=8, kernel=5)
    result = llama.runtime.prefill(prompt, press)
    expected = math.ceil(0.25 * LENGTH)
    assert result.kept_tokens_per_layer == [expected] * NUM_LAYERS
    assert result.press_config["ratio"] == 0.25


@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "h2o", "random", "pyramidkv"])
def test_prompt_that_fits_the_budget_is_kept_whole(llama, name: str) -> None:
    short = random_prompt(30, seed=5)
    result = llama.runtime.prefill(short, make_press(name, budget=40, window=8))
    assert result.kv_bytes_kept == result.kv_bytes_full
    for indices, layer in zip(kept_indices(result), result.cache.layers, strict=True):
        assert indices.tolist() == [list(range(30))] * KV_HEADS
        assert layer.keys.shape[-2] == 30


@pytest.mark.parametrize("budget", [24, 64])
def test_every_press_keeps_sorted_indices_and_the_window(llama, prompt, budget: int) -> None:
    window = 8
    presses = [
        SnapKVPress(budget=budget, window=window, kernel=5, pooling="avg"),
        StreamingLLMPress(budget=budget, window=window),
        H2OPress(budget=budget, window=window),
        RandomPress(budget=budget, window=window),
        PyramidKVPress(budget=budget, window=window),
    ]
    for result in llama.runtime.prefill_many(prompt, presses):
        for indices in kept_indices(result):
            assert torch.equal(indices, indices.sort(dim=-1).values)
            assert all(len(set(head.tolist())) == head.shape[0] for head in indices)
            window_positions = torch.arange(LENGTH - window, LENGTH)
            assert torch.equal(indices[:, -window:], window_positions.expand(KV_HEADS, -1))


# -- the compressed cache ----------------------------------------------------------------


def test_cache_shapes_and_memory_after_compression(llama, prompt) -> None:
    budget = 40
    result = llama.runtime.prefill(prompt, SnapKVPress(budget=budget, window=8))
    assert len(result.cache.layers) == NUM_LAYERS
    for layer in result.cache.layers:
        assert layer.keys.shape == (1, KV_HEADS, budget, HEAD_DIM)
        assert layer.values.shape == (1, KV_HEADS, budget, HEAD_DIM)
        # the kept entries own their memory: the full prompt's tensors can be freed
        assert layer.keys.untyped_storage().nbytes() == layer.keys.nbytes
        assert layer.values.untyped_storage().nbytes() == layer.values.nbytes
    full_bytes = NUM_LAYERS * 2 * KV_HEADS * LENGTH * HEAD_DIM * 4
    assert result.kv_bytes_full == full_bytes
    assert result.kv_bytes_kept == cache_nbytes(result.cache) == full_bytes * budget // LENGTH
    assert result.kept_tokens == budget


def test_hooks_see_the_cache_on_every_layer(llama, prompt) -> None:
    """Fails loudly when a transformers upgrade hides the cache from the attention hook."""
    model = llama.loaded.model
    press = SnapKVPress(budget=24, window=8)
    with compression_hooks(model, press) as recorder, torch.no_grad():
        model(input_ids=torch.tensor([prompt]), cache=DynamicCache(config=model.config))
        assert recorder.results[0] == {}  # not armed: nothing happens
        recorder.armed = True
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        assert sorted(recorder.results[0]) == list(range(NUM_LAYERS))
        assert recorder.skipped_layers == set()
        assert all(layer.keys.shape[-2] == 24 for layer in cache.layers)
        with pytest.raises(RuntimeError, match="saw no KV cache"):
            model(input_ids=torch.tensor([prompt]), use_cache=False)
    hooked = [m for m in model.modules() if m._forward_hooks]
    assert hooked == []  # removed on exit


def test_prefill_many_equals_separate_prefills_and_leaves_the_base_cache(llama, prompt) -> None:
    presses = [SnapKVPress(budget=32, window=8), H2OPress(budget=32, window=8), FullPress()]
    shared = llama.runtime.prefill_many(prompt, presses)
    for press, result in zip(presses, shared, strict=True):
        alone = llama.runtime.prefill(prompt, press)
        for a, b in zip(kept_indices(alone), kept_indices(result), strict=True):
            assert torch.equal(a, b)
        step_alone = llama.runtime.forward([5], alone.cache, LENGTH)
        step_shared = llama.runtime.forward([5], result.cache, LENGTH)
        torch.testing.assert_close(step_alone, step_shared)
    # decoding on the derived caches did not touch the full one the presses shared
    assert shared[2].cache.layers[0].keys.shape[-2] == LENGTH + 1
    assert shared[0].cache.layers[0].keys.shape[-2] == 32 + 1


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_layers_are_left_whole_and_decoding_works(attn: str) -> None:
    """A Mistral whose every layer slides (window 64 > prompt): nothing may be evicted, since
    the sliding layer's masks count positions; Gemma3 compresses only its full layers."""
    mistral = tiny_engine("mistral", attn, sliding_window=64)
    short = random_prompt(48, seed=6)
    result = mistral.runtime.prefill(short, SnapKVPress(budget=24, window=8))
    assert result.kept == []
    assert all(layer.keys.shape[-2] == 48 for layer in result.cache.layers)
    logits = mistral.runtime.forward([5], result.cache, 48)
    assert torch.isfinite(logits).all()

    gemma = tiny_engine("gemma3", attn)
    result = gemma.runtime.prefill(random_prompt(LENGTH, seed=6), SnapKVPress(budget=24, window=8))
    assert [layer.keys.shape[-2] for layer in result.cache.layers] == [15, 24, 15, 24]
    for step in range(3):
        logits = gemma.runtime.forward([5 + step], result.cache, LENGTH + step)
        assert torch.isfinite(logits).all()
    assert [layer.keys.shape[-2] for layer in result.cache.layers] == [15, 27, 15, 27]
