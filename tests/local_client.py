"""The app's test client as a local browser or script reaches it: ``Host: localhost``.

Starlette's default ``Host: testserver`` is a name a keyless server does not answer
(api/middleware.py: accepted_hosts), as a real server would not."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient


class LocalClient(TestClient):
    def __init__(self, app: Any, base_url: str = "http://localhost", **kwargs: Any) -> None:
        super().__init__(app, base_url=base_url, **kwargs)
