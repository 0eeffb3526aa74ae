"""Helpers for the API tests: a real uvicorn server on a free loopback port, SSE parsing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

DOCS = [
    {
        "id": "bees",
        "title": "Bees",
        "text": "Honeybees tell each other where flowers are with a waggle dance.",
    },
    {
        "id": "tides",
        "title": "Tides",
        "text": "Tides are caused mostly by the gravity of the Moon.",
    },
]
# small press settings keep each answer cheap on the CPU test model
FAST = {"press": "snapkv", "budget": 48, "window": 8}


@contextmanager
def running_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a background thread; yields its base URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def parse_sse(lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """``(event name, decoded data)`` for each event of a Server-Sent Events body."""
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                text = "\n".join(data)
                yield name, (text if text == "[DONE]" else json.loads(text))
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        text = "\n".join(data)
        yield name, (text if text == "[DONE]" else json.loads(text))
