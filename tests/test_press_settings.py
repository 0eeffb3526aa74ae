"""The press settings, declared once (engine/press_settings.py), and a request's options
resolved once (engine/request_options.py): every entrance gets the same press from the same
settings. No model: presses are built, never run."""

from __future__ import annotations

import pytest

from ragsnap.compression import press_options
from ragsnap.compression.base import DEFAULT_BUDGET, DEFAULT_WINDOW
from ragsnap.engine.config import EngineConfig, configured
from ragsnap.engine.press_settings import PressOverrides
from ragsnap.engine.request_options import answer_options, resolve_press
from ragsnap.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_press_environment(monkeypatch):
    for name in EngineConfig.model_fields:
        monkeypatch.delenv(f"RAGSNAP_{name.upper()}", raising=False)


def test_the_budget_is_a_setting_with_its_default_written_once(monkeypatch):
    config = EngineConfig()
    assert (config.budget, config.window) == (DEFAULT_BUDGET, DEFAULT_WINDOW)
    assert resolve_press(config).config()["budget"] == DEFAULT_BUDGET
    monkeypatch.setenv("RAGSNAP_BUDGET", "96")
    assert resolve_press(EngineConfig(default_press="snapkv")).config()["budget"] == 96


def test_a_ratio_replaces_the_default_budget_and_a_request_size_replaces_the_pair():
    config = EngineConfig(default_press="snapkv", ratio=0.25)
    assert (config.budget, config.ratio) == (None, 0.25)
    asked = resolve_press(config, PressOverrides(budget=64)).config()
    assert (asked["budget"], asked["ratio"]) == (64, None)
    with pytest.raises(ConfigError, match="not both"):
        configured(EngineConfig, budget=64, ratio=0.5)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"budget": 16, "window": 32}, "budget"),
        ({"decode_slack": 8, "decode_window": 16}, "decode_window"),
        ({"kernel": 4}, "kernel"),
        ({"budget": 0}, "budget"),
    ],
)
def test_a_bad_setting_names_itself_before_any_model_loads(given, field):
    with pytest.raises(ConfigError) as info:
        configured(EngineConfig, **given)
    assert info.value.field == field


def test_a_configured_option_goes_only_to_the_presses_that_take_it():
    config = EngineConfig(kernel=5, lookahead=4)
    assert resolve_press(config, PressOverrides(press="snapkv")).config()["kernel"] == 5
    h2o = resolve_press(config, PressOverrides(press="h2o")).config()  # no kernel, no lookahead
    assert h2o["press"] == "h2o" and "kernel" not in h2o and "lookahead" not in h2o
    assert "lookahead" not in press_options("h2o") and "kernel" in press_options("snapkv")
    with pytest.raises(ConfigError) as info:  # a request's own option must suit its press
        resolve_press(config, PressOverrides(press="h2o", kernel=3))
    assert info.value.field == "kernel"


def test_request_options_take_the_configuration_for_what_a_request_leaves_unset():
    config = EngineConfig(
        default_press="snapkv",
        budget=48,
        window=8,
        default_max_new_tokens=7,
        unsupported="abstain",
        document_order="given",
        decode_slack=32,
    )
    options = answer_options(config)
    assert options.press.config()["budget"] == 48
    assert options.generation.max_new_tokens == 7
    assert options.citations.unsupported == "abstain"
    assert options.document_order == "given"
    assert options.decode_compression is not None and options.decode_compression.slack == 32
    asked = answer_options(
        config,
        PressOverrides(press="tova", decode_window=4),
        generation={"max_new_tokens": None, "temperature": 0.5},
        citations={"unsupported": None, "mode": "markers"},
    )
    assert asked.press.config()["press"] == "tova" and asked.press.config()["budget"] == 48
    assert asked.generation.max_new_tokens == 7 and asked.generation.temperature == 0.5
    assert asked.citations.unsupported == "abstain" and asked.citations.mode == "markers"
    assert asked.decode_compression is not None and asked.decode_compression.window == 4


def test_propagation_votes_of_a_prompt_inside_the_window_are_empty():
    """A window longer than the prompt leaves no position to rank (schemathesis found the
    500 it was: max_pool1d over nothing)."""
    import torch

    from ragsnap.compression.base import LayerContext
    from ragsnap.runtime.propagation import token_votes

    keys = torch.zeros(1, 1, 5, 4)
    layer = LayerContext(
        layer_idx=0,
        num_layers=2,
        module=None,
        keys=keys,
        values=keys,
        hidden_states=torch.zeros(1, 5, 8),
        position_embeddings=(torch.zeros(1, 5, 4), torch.zeros(1, 5, 4)),
    )
    assert token_votes(layer, window=32, kernel=7, pooling="max").shape == (0,)
