"""Profiled layer budgets: the uniform total is kept exactly, shares follow sqrt(sensitivity),
profiles are checked against the model, and calibration measures and merges per-layer KL."""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.compression.layer_budgets import (
    MIN_SHARE,
    LayerProfile,
    model_fingerprint,
    packaged_profile,
    split_budget,
)
from ragsnap.errors import ConfigError, InputError
from ragsnap.eval.calibrate import calibrate_layers, item_layer_kl
from ragsnap.eval.items import EvalItem
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import random_prompt, tiny_config, tiny_engine


def _profile(sensitivity, model="m") -> LayerProfile:
    return LayerProfile(model=model, sensitivity=tuple(sensitivity), budget=128)


def test_split_budget_keeps_the_uniform_total_and_follows_the_shares() -> None:
    shares = _profile([0.0, 1.0, 4.0, 9.0, 16.0, 0.5, 2.0]).shares()
    for free in (1, 7, 96, 480):
        parts = split_budget(free, shares)
        assert sum(parts) == free * len(shares)
        assert all(abs(p - free * s) < 1 for p, s in zip(parts, shares, strict=True))
    # a layer capped by its prompt passes its excess on to the others, by share
    capped = split_budget(96, (3.0, 0.5, 0.5), cap=150)
    assert capped == [150, 69, 69]
    assert split_budget(96, (3.0, 0.5, 0.5), cap=50) == [50, 50, 50]


def test_shares_grow_with_the_square_root_of_sensitivity_above_a_floor() -> None:
    shares = _profile([1.0, 4.0, 16.0, 0.0]).shares()
    assert sum(shares) == pytest.approx(len(shares))
    assert shares[1] / shares[0] == pytest.approx(2.0)
    assert shares[2] / shares[0] == pytest.approx(4.0)
    assert shares[3] / shares[0] == pytest.approx(MIN_SHARE / (4 / 7))  # raw share of layer 0: 4/7
    assert _profile([0.0, 0.0]).shares() == (1.0, 1.0)


def test_profiles_round_trip_and_bad_files_are_named(tmp_path) -> None:
    profile = LayerProfile("m", (0.1, 0.2), 64, items=("a", "b"), source="test")
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert LayerProfile.load(path) == profile
    path.write_text('{"version": 1, "model": "m", "budget": 64, "sensitivity": [0.1, -1]}')
    with pytest.raises(InputError, match="p.json is not a layer profile: sensitivity"):
        LayerProfile.load(path)
    with pytest.raises(InputError, match="layer profile not found"):
        make_press("ragsnap", budget=64, profile=str(tmp_path / "missing.json"))


def _kept_per_layer(engine, prompt, press) -> list[int]:
    [result] = engine.runtime.prefill_many(prompt, [press])
    return result.kept_tokens_per_layer


def test_profiled_budgets_move_tokens_between_layers_at_the_same_total(tmp_path) -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(120, seed=3)
    fingerprint = model_fingerprint(tiny_config("llama"))
    path = tmp_path / "profile.json"
    path.write_text(_profile([0.0, 1.0, 4.0, 16.0], model=fingerprint).to_json())
    uniform = _kept_per_layer(engine, prompt, make_press("snapkv", budget=40, window=8))
    profiled = _kept_per_layer(
        engine, prompt, make_press("layerbudget", budget=40, window=8, profile=str(path))
    )
    assert uniform == [40] * 4
    assert sum(profiled) == sum(uniform)
    assert profiled == sorted(profiled) and profiled[0] < 40 < profiled[-1]
    assert all(n >= 8 for n in profiled)  # the window is always kept
    # the same profile drives the default press
    combined = _kept_per_layer(
        engine, prompt, make_press("ragsnap", budget=40, window=8, profile=str(path))
    )
    assert combined == profiled


def test_no_profile_is_uniform_snapkv_and_a_foreign_profile_is_refused(tmp_path) -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(100, seed=4)
    [snap, auto, uniform] = engine.runtime.prefill_many(
        prompt,
        [
            make_press("snapkv", budget=32, window=8),
            make_press("layerbudget", budget=32, window=8),  # no packaged tiny profile
            make_press("layerbudget", budget=32, window=8, profile="uniform"),
        ],
    )
    for a, b, c in zip(snap.kept, auto.kept, uniform.kept, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.indices, c.indices)
    path = tmp_path / "other.json"
    path.write_text(_profile([1.0] * 4, model="llama-L30-d576").to_json())
    # the press config (part of the cache key) names the profile's content, not just its path
    before = make_press("ragsnap", budget=32, profile=str(path)).config()
    path.write_text(_profile([1.0, 2.0, 3.0, 4.0], model="llama-L30-d576").to_json())
    after = make_press("ragsnap", budget=32, profile=str(path)).config()
    assert before["profile"] == after["profile"]
    assert before["profile_digest"] != after["profile_digest"]
    with pytest.raises(ConfigError, match="measured on llama-L30-d576, not this model"):
        engine.runtime.prefill_many(
            prompt, [make_press("layerbudget", budget=32, profile=str(path))]
        )


def test_a_layer_left_with_only_its_window_keeps_exactly_the_window(tmp_path) -> None:
    engine = tiny_engine("llama")
    path = tmp_path / "skewed.json"
    fingerprint = model_fingerprint(tiny_config("llama"))
    path.write_text(_profile([0.0, 0.0, 1.0, 100.0], model=fingerprint).to_json())
    prompt = random_prompt(60, seed=1)
    [skewed, window_only] = engine.runtime.prefill_many(
        prompt,
        [
            make_press("ragsnap", budget=10, window=8, profile=str(path)),
            make_press("wordspan", budget=8, window=8),
        ],
    )
    assert skewed.kept_tokens_per_layer == [8, 8, 9, 15]
    for layer in (skewed.kept[0], *window_only.kept):
        assert layer.indices[0, 0].tolist() == list(range(52, 60))


@pytest.mark.model
def test_the_embedded_model_has_a_packaged_profile(engine) -> None:
    config = engine.loaded.model.config
    profile = packaged_profile(model_fingerprint(config))
    assert profile is not None
    assert len(profile.sensitivity) == config.num_hidden_layers
    assert len(profile.items) >= 10


def _item(name: str, question: str, text: str) -> EvalItem:
    return EvalItem(id=name, question=question, documents=[Document(id=name, text=text)])


@pytest.mark.model
def test_calibration_measures_per_layer_kl_and_extends_a_profile(engine) -> None:
    generation = GenerationConfig(max_new_tokens=4, temperature=0.0)
    tides = _item(
        "tides",
        "What causes tides?",
        "Tides are caused mainly by the gravity of the Moon pulling on the oceans. " * 4,
    )
    bees = _item(
        "bees",
        "How do honeybees tell others where food is?",
        "Honeybees perform a waggle dance whose angle points to the food source. " * 4,
    )
    layers = engine.loaded.model.config.num_hidden_layers
    whole = item_layer_kl(engine.runtime, tides, generation, budget=4096)
    assert max(whole) < 1e-6 and len(whole) == layers  # a budget over the prompt: float noise only
    first = calibrate_layers(engine.runtime, [tides], generation, budget=48)
    assert first.items == ("tides",) and len(first.sensitivity) == layers
    assert max(first.sensitivity) > 0 and min(first.sensitivity) >= 0
    bees_kl = item_layer_kl(engine.runtime, bees, generation, budget=48)
    both = calibrate_layers(engine.runtime, [tides, bees], generation, budget=48, previous=first)
    assert both.items == ("tides", "bees")  # tides was not measured again
    expected = [(a + b) / 2 for a, b in zip(first.sensitivity, bees_kl, strict=True)]
    assert list(both.sensitivity) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    with pytest.raises(ConfigError, match="at budget 48, not"):
        calibrate_layers(engine.runtime, [bees], generation, budget=64, previous=first)
