"""The service with a KV store: one cache namespace per API key, cache state in /readyz."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.api_helpers import DOCS, FAST, running_server

KEYS = ("cache-key-a", "cache-key-b")


@pytest.fixture(scope="module")
def base_url(engine, tmp_path_factory):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    store = open_store(f"file://{tmp_path_factory.mktemp('kv')}")
    # the same loaded model, with a store and no loaded entries (hits read the store)
    cached = RagSnapEngine(engine.loaded, store=store, hit_memory_mb=0)
    with running_server(create_app(Settings(api_keys=",".join(KEYS)), engine=cached)) as url:
        yield url


def ask(base_url, key):
    body = {
        "question": "What causes tides?",
        "documents": DOCS,
        "max_new_tokens": 2,
        "compression": FAST,
    }
    response = httpx.post(
        f"{base_url}/v1/answer", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_each_key_has_its_own_cache_namespace(base_url):
    ready = httpx.get(f"{base_url}/readyz").json()
    assert ready["cache"]["state"] == "ok" and ready["cache"]["backend"].startswith("file")

    first = ask(base_url, KEYS[0])
    again = ask(base_url, KEYS[0])
    other = ask(base_url, KEYS[1])
    assert first["meta"]["cache"] == "miss"
    assert again["meta"]["cache"] == "hit" and again["answer"] == first["answer"]
    assert other["meta"]["cache"] == "miss"  # the same prompt under another key is not shared
    assert again["stats"]["prefill_tokens"] < first["stats"]["prefill_tokens"]

    metrics = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    assert 'ragsnap_cache_lookups_total{result="hit"} 1.0' in metrics
    assert 'ragsnap_cache_lookups_total{result="miss"} 2.0' in metrics
    read = re.search(r'ragsnap_cache_bytes_total\{direction="read"\} (\S+)', metrics)
    assert read and float(read.group(1)) > 0
