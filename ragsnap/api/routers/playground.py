"""The web playground: one static page at ``/`` and its script and style sheet.

The files are public (they hold no data); everything the page asks for goes to ``/v1/...``
with the API key the user types in, so the guard treats its calls like any client's. The
Content-Security-Policy lets the page load nothing but this server's own files.
"""

from __future__ import annotations

from importlib import resources
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter(include_in_schema=False)

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> Response:
    # read per request (a few kB): nothing happens at import, and edits show on reload
    body = resources.files("ragsnap.api.playground").joinpath(name).read_bytes()
    return Response(body, media_type=_TYPES[name], headers=_HEADERS)


@router.get("/")
async def page() -> Response:
    return _asset("index.html")


@router.get("/playground/{name}")
async def asset(name: Literal["app.js", "style.css"]) -> Response:
    return _asset(name)
