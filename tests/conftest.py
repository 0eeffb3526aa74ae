"""Shared fixtures. The embedded model is loaded once per test session (about 30 s on CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _shared_cache_key(monkeypatch):
    """Tests run as a deployment does: a shared store (Redis, Ray replicas) needs a sealing
    key, so the environment has one (tests/test_cache_defaults.py removes it to check the
    keyless defaults; a test may set its own)."""
    monkeypatch.setenv("RAGSNAP_CACHE_KEY", "ragsnap-test-suite-key")


def pytest_collection_modifyitems(items):
    """Every test that uses the embedded engine, directly or through another fixture,
    carries the ``model`` marker, so ``-m "not model"`` never loads the model."""
    for item in items:
        if "engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def engine():
    """The real engine on the embedded SmolLM2-135M-Instruct model (CPU)."""
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.runtime.threads import available_cores

    # no store (tests that cache build their own engine on its model); every core, as
    # before the engine configured threads itself
    return RagSnapEngine.load(
        "embedded",
        device="cpu",
        dtype="float32",
        cache_url="none",
        threads=available_cores(),
        speculate=0,  # plain decoding: drafting is tested where a test turns it on
        speculate_ngrams=False,
        commit_lookahead=False,
    )


@pytest.fixture
def tiny(monkeypatch):
    """A tiny random Llama engine that ``RagSnapEngine.load`` and ``from_config`` return
    (CLI tests), with the configuration they were given; ``load_runtime`` returns its
    runtime (``eval``, ``calibrate``, ``diagnose``), and so does ``plain_runtime`` (``bench``)."""
    from ragsnap.engine.config import EngineConfig, configured
    from ragsnap.engine.engine import RagSnapEngine
    from tests.tiny_models import tiny_engine

    engine = tiny_engine("llama", "sdpa")

    def from_config(cls, config, **_options):
        engine.config = config
        return engine

    def load(cls, model="embedded", **given):
        given = {k: v for k, v in given.items() if v is not None and k in EngineConfig.model_fields}
        return from_config(cls, configured(EngineConfig, model=model or "embedded", **given))

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(from_config))
    monkeypatch.setattr(RagSnapEngine, "load", classmethod(load))
    monkeypatch.setattr("ragsnap.engine.loading.load_runtime", lambda config, **k: engine.runtime)
    monkeypatch.setattr("ragsnap.engine.loading.plain_runtime", lambda **fields: engine.runtime)
    return engine


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port for the whole session (tests use their own namespaces)."""
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_factory():
    """Start extra redis-servers (``redis_factory(*args)``) that a test may stop and restart."""
    from tests.redis_server import RedisServer

    servers: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        server = RedisServer(None, *extra_args).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _private_caches(tmp_path_factory):
    """Point the default KV store (``ragsnap ask`` without ``--cache``) and the converted
    model weights at temporary directories, so test runs neither read nor fill the user's
    own caches (the weights are converted once per run; later loads, subprocesses
    included, read them from there), and compute in float32 whatever the CPU."""
    import os

    private = {
        "RAGSNAP_CACHE_URL": f"file://{tmp_path_factory.mktemp('kv-cache')}",
        "RAGSNAP_MODEL_CACHE": str(tmp_path_factory.mktemp("model-cache")),
        # exactness tests compare float32 runs; bfloat16 has its own tests
        "RAGSNAP_DTYPE": "float32",
    }
    previous = {name: os.environ.get(name) for name in private}
    os.environ.update(private)
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
