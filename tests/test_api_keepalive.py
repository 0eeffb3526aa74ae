"""Streams send keep-alive comments while nothing else is ready (a long prefill)."""

from __future__ import annotations

import httpx
import pytest

from tests.api_helpers import DOCS, FAST, parse_sse, running_server


@pytest.mark.model
def test_a_stream_carries_pings_that_clients_skip(engine, monkeypatch):
    from ragsnap.api import streaming
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    monkeypatch.setattr(streaming, "PING_S", 0.005)  # shorter than any prefill
    body = {"question": "What causes tides?", "documents": DOCS, "max_new_tokens": 4}
    with running_server(create_app(Settings(), engine=engine)) as url:
        with httpx.stream(
            "POST", f"{url}/v1/answer", json={**body, "compression": FAST, "stream": True}
        ) as response:
            lines = list(response.iter_lines())
    assert response.status_code == 200
    assert any(line.startswith(": ping") for line in lines)
    names = [name for name, _ in parse_sse(lines)]
    assert names[0] == "meta" and names[-1] == "done" and "token" in names
