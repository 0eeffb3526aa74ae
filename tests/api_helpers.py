"""Helpers for the API tests: a real uvicorn server on a free loopback port, SSE parsing."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from ragsnap.api.local_server import running_server  # noqa: F401  (the tests import it from here)

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


def fast_settings(**fields: Any) -> Any:
    """Server settings whose default press is :data:`FAST`, with ``fields`` over them."""
    from ragsnap.api.settings import Settings

    return Settings(
        default_press=FAST["press"], budget=FAST["budget"], window=FAST["window"], **fields
    )


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
