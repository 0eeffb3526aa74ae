"""Network defaults of the real app (issue 40): the Host names a keyless server answers,
and what /metrics and /readyz tell with API keys set. The model never loads here."""

from __future__ import annotations

import socket

import pytest

from tests.local_client import LocalClient

KEY, METRICS_KEY = "tenant-key", "scraper-key"


def client(**settings) -> LocalClient:
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    return LocalClient(create_app(Settings(cache_url="none", **settings)))


def code(response) -> str:
    return response.json()["error"]["code"]


def test_a_keyless_local_server_answers_only_local_names():
    local = client()
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "10.0.0.1"):
        refused = local.post("/v1/answer", json={}, headers={"Host": host})
        assert refused.status_code == 400 and code(refused) == "invalid_host"
    for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000"):
        assert local.get("/healthz", headers={"Host": host}).status_code == 200
    assert local.get("/").status_code == 200  # the playground, as a browser on localhost


def test_the_bind_address_and_on_every_interface_the_machine_names_are_local():
    assert client(host="10.1.2.3").get("/healthz", headers={"Host": "10.1.2.3"}).status_code == 200
    everywhere = client(host="0.0.0.0")
    assert everywhere.get("/healthz", headers={"Host": socket.gethostname()}).status_code == 200
    assert everywhere.get("/healthz", headers={"Host": "evil.example"}).status_code == 400


def test_allowed_hosts_and_api_keys_widen_the_default():
    assert (
        client(allowed_hosts="*").get("/healthz", headers={"Host": "x.example"}).status_code == 200
    )
    keyed = client(api_keys=KEY)  # the keys guard the API: any name may reach it
    assert keyed.get("/healthz", headers={"Host": "api.example.com"}).status_code == 200
    listed = client(allowed_hosts="api.example.com")  # an explicit list replaces the default
    assert listed.get("/healthz", headers={"Host": "localhost"}).status_code == 400


def test_metrics_are_public_without_keys_and_need_a_key_with_them():
    assert client().get("/metrics").status_code == 200
    keyed = client(api_keys=KEY, metrics_key=METRICS_KEY)
    assert code(keyed.get("/metrics")) == "missing_api_key"
    assert (
        code(keyed.get("/metrics", headers={"Authorization": "Bearer nope"})) == "invalid_api_key"
    )
    for key in (KEY, METRICS_KEY):
        shown = keyed.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert shown.status_code == 200 and "ragsnap_" in shown.text
    # the metrics key opens nothing else
    refused = keyed.get("/v1/models", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert refused.status_code == 401


@pytest.mark.parametrize("url", ["redis://10.9.8.7:6390/3", "file:///srv/secret-folder"])
def test_store_names_are_kinds_never_hosts_or_paths(url, tmp_path, monkeypatch):
    pytest.importorskip("redis")
    from ragsnap.cache import open_store

    monkeypatch.setenv("RAGSNAP_CACHE_KEY", "k")
    store = open_store(url.replace("/srv", str(tmp_path)))
    assert store.public_name() == url.split(":")[0]
