"""``ragsnap serve`` option handling (the server itself is exercised by the other API tests)."""

from __future__ import annotations

import pytest

from ragsnap.cli import build_parser
from ragsnap.errors import ConfigError


def test_serve_options_override_the_environment(monkeypatch):
    from ragsnap.cli.serve import settings_from_args

    monkeypatch.setenv("RAGSNAP_PORT", "9001")
    monkeypatch.setenv("RAGSNAP_MAX_DOCUMENTS", "5")
    monkeypatch.setenv("RAGSNAP_API_KEYS", "k1, k2")
    args = build_parser().parse_args(
        ["serve", "--port", "9100", "--cache", "none", "--max-queue", "3"]
    )
    settings = settings_from_args(args)
    assert (settings.port, settings.cache_url, settings.max_queue) == (9100, "none", 3)
    assert settings.max_documents == 5 and settings.host == "127.0.0.1"
    assert [k.get_secret_value() for k in settings.api_keys] == ["k1", "k2"]
    assert "k1" not in repr(settings)  # keys never show up in reprs or logs


def test_bad_setting_is_a_config_error(monkeypatch):
    from ragsnap.cli.serve import settings_from_args

    monkeypatch.setenv("RAGSNAP_MAX_QUEUE", "0")
    with pytest.raises(ConfigError, match="max_queue"):
        settings_from_args(build_parser().parse_args(["serve"]))


def test_the_default_press_is_a_setting_checked_at_start(monkeypatch):
    from ragsnap.cli.serve import settings_from_args

    monkeypatch.setenv("RAGSNAP_DEFAULT_PRESS", "ragsnap")
    assert settings_from_args(build_parser().parse_args(["serve"])).default_press == "ragsnap"
    monkeypatch.setenv("RAGSNAP_DEFAULT_PRESS", "zip")
    with pytest.raises(ConfigError, match="default_press.*unknown press 'zip'"):
        settings_from_args(build_parser().parse_args(["serve"]))


def test_speculation_is_a_bounded_setting(monkeypatch):
    from ragsnap.cli.serve import settings_from_args

    settings = settings_from_args(build_parser().parse_args(["serve"]))
    assert (settings.speculate, settings.speculate_ngrams) == (8, True)
    args = build_parser().parse_args(["serve", "--speculate", "0", "--no-speculate-ngrams"])
    assert (settings_from_args(args).speculate, settings_from_args(args).speculate_ngrams) == (
        0,
        False,
    )
    monkeypatch.setenv("RAGSNAP_SPECULATE", "17")
    with pytest.raises(ConfigError, match="speculate"):
        settings_from_args(build_parser().parse_args(["serve"]))


def test_prompts_prefill_on_every_core_unless_told(monkeypatch):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from ragsnap.cli.serve import settings_from_args
    from ragsnap.runtime.threads import available_cores
    from tests.local_client import LocalClient
    from tests.tiny_models import tiny_engine

    args = build_parser().parse_args(["serve", "--prefill-threads", "3"])
    assert settings_from_args(args).prefill_threads == 3
    monkeypatch.setenv("RAGSNAP_PREFILL_THREADS", "0")
    with pytest.raises(ConfigError, match="prefill_threads"):
        settings_from_args(build_parser().parse_args(["serve"]))
    monkeypatch.delenv("RAGSNAP_PREFILL_THREADS")
    engine = tiny_engine("llama")
    for settings, expected in ((Settings(), available_cores()), (Settings(prefill_threads=1), 1)):
        with LocalClient(create_app(settings, engine=engine)) as client:
            assert client.get("/readyz").status_code == 200
            assert client.app.state.services.worker.scheduler.prefill_threads == expected


def test_a_server_with_a_prefix_tier_reserves_its_batch_memory_at_start(tmp_path):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from ragsnap.cache import open_store
    from ragsnap.cli.serve import settings_from_args
    from ragsnap.engine.engine import RagSnapEngine
    from tests.local_client import LocalClient
    from tests.tiny_models import tiny_engine

    args = build_parser().parse_args(["serve", "--prefix-memory-mb", "64"])
    assert settings_from_args(args).prefix_memory_mb == 64
    loaded = tiny_engine("llama").loaded
    for tokens, store in ((96, f"file://{tmp_path}"), (0, f"file://{tmp_path}"), (96, "none")):
        engine = RagSnapEngine(loaded, store=open_store(store))
        settings = Settings(max_batch=3, reserve_prefix_tokens=tokens)
        with LocalClient(create_app(settings, engine=engine)) as client:
            assert client.get("/readyz").status_code == 200
        scratch = engine.runtime._tail_scratch
        if tokens and store != "none":
            assert scratch and all(k.shape[0] == 3 and k.shape[2] == 96 for k, _ in scratch)
        else:  # nothing reserved: caching off, or told not to
            assert scratch == []


def test_serve_leaves_multi_threaded_compute_to_the_scheduler() -> None:
    import torch

    from ragsnap.api.settings import Settings
    from ragsnap.cli.serve import keep_threads_for_the_scheduler

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert keep_threads_for_the_scheduler(Settings()).decode_threads == 3
        assert torch.get_num_threads() == 1  # the HTTP thread computes on one
        assert keep_threads_for_the_scheduler(Settings(decode_threads=2)).decode_threads == 2
    finally:
        torch.set_num_threads(before)
