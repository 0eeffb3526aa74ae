"""ASGI middleware: a request id and one structured log line per request, and the guard
that checks the API key and the body size before anything parses the body."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import OPENAI_PREFIX, error_body
from api.metrics import ServiceMetrics
from api.settings import Settings

access_logger = logging.getLogger("ragsnap.api.access")


class RequestLogMiddleware:
    """Gives each request an id (``X-Request-ID``) and logs one JSON line when it ends.

    Routes add fields (timings, cache status, outcome) to ``scope["state"]["log"]``; the
    line never holds the question or document text.
    """

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        log: dict[str, Any] = {"request_id": request_id}
        scope.setdefault("state", {})["log"] = log
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = _route_label(scope)
            self.metrics.requests.labels(path, str(status)).inc()
            line = {
                "request_id": request_id,
                "method": scope.get("method"),
                "path": scope.get("path"),
                "status": status,
                "duration_s": round(time.perf_counter() - started, 4),
                **{k: v for k, v in log.items() if k != "request_id"},
            }
            access_logger.info(json.dumps(line, default=str, separators=(",", ":")))


class GuardMiddleware:
    """For ``/v1/...``: 401 without a valid API key, 413 for a body over ``max_body_bytes``.

    The caller's cache namespace (one per key) goes to ``scope["state"]["namespace"]``.
    A body without ``Content-Length`` is read here up to the limit and replayed.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.namespaces = settings.key_digests()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        namespace, problem = self._authenticate(scope)
        if problem:
            await self._reject(scope, receive, send, 401, problem[0], problem[1])
            return
        state["namespace"] = namespace
        if namespace != "default":
            state.setdefault("log", {})["namespace"] = namespace
        limit = self.settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._reject(
                scope, receive, send, 413, f"request body over {limit} bytes", "body_too_large"
            )
            return
        if declared is None and scope["method"] in {"POST", "PUT", "PATCH"}:
            body = b""
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    await self._reject(
                        scope,
                        receive,
                        send,
                        413,
                        f"request body over {limit} bytes",
                        "body_too_large",
                    )
                    return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> tuple[str, tuple[str, str] | None]:
        if not self.settings.auth_enabled:
            return "default", None
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "", ("missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        digest = hashlib.sha256(token.strip().encode("utf-8")).hexdigest()
        found = ""
        for known, namespace in self.namespaces.items():
            if hmac.compare_digest(known, digest):
                found = namespace
        return (found, None) if found else ("", ("invalid API key", "invalid_api_key"))

    @staticmethod
    async def _reject(
        scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str
    ) -> None:
        param = "body" if status == 413 else None
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        scope.setdefault("state", {}).setdefault("log", {})["error"] = code
        response = JSONResponse(
            error_body(status, message, param, code), status_code=status, headers=headers
        )
        await response(scope, receive, send)


def _route_label(scope: Scope) -> str:
    """The matched route's path, else the raw path when the app has such a route (a request
    refused before routing), else ``unmatched``: labels stay few whatever clients send."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return str(route.path)
    app = scope.get("app")
    paths = {getattr(r, "path", None) for r in getattr(app, "routes", ())}
    return str(scope["path"]) if scope.get("path") in paths else "unmatched"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


__all__ = ["GuardMiddleware", "RequestLogMiddleware", "OPENAI_PREFIX"]
