"""The playground's files: public, self-contained (CSP), off with ``playground=False``;
the API calls it makes stay behind the key. No model is loaded (no lifespan runs)."""

from __future__ import annotations

import re

from ragsnap.api.app import create_app
from ragsnap.api.settings import Settings
from tests.local_client import LocalClient


def client(**settings) -> LocalClient:
    return LocalClient(create_app(Settings(**settings)))  # no `with`: the model never loads


def test_page_and_assets_are_public_but_the_api_needs_the_key():
    http = client(api_keys="secret")
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for name, kind in [("app.js", "text/javascript"), ("style.css", "text/css")]:
        asset = http.get(f"/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert asset.headers["x-content-type-options"] == "nosniff"
    assert http.get("/playground/index.html").status_code == 422  # only the named assets
    assert http.get("/playground/../api/app.py").status_code == 404
    search = http.post("/v1/search", json={"query": "tides"})
    assert search.status_code == 401
    assert http.get("/openapi.json").status_code == 404  # docs stay hidden behind keys


def test_page_loads_nothing_from_elsewhere():
    http = client()
    html = http.get("/").text
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources and all(s.startswith("/playground/") or s == "data:," for s in sources)
    script = http.get("/playground/app.js").text
    urls = re.findall(r"https?://", script + http.get("/playground/style.css").text)
    assert urls == []


def test_playground_can_be_turned_off():
    http = client(playground=False)
    assert http.get("/").status_code == 404
    assert http.get("/healthz").status_code == 200
