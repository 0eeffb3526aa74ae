"""ASGI middleware: a request id and one structured log line per request, and the guard
that checks the API key and the body size before anything parses the body."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragsnap.api.errors import OPENAI_PREFIX, error_body
from ragsnap.api.metrics import ServiceMetrics
from ragsnap.api.settings import Settings

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


DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
METRICS_PATH = "/metrics"
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_ANY_ADDRESS = frozenset({"0.0.0.0", "::", ""})


def accepted_hosts(settings: Settings) -> set[str]:
    """The ``Host`` names the server answers: ``allowed_hosts`` when set; any (``*``) with
    API keys; else the names of the bind address, so a web page on another origin cannot
    reach a local, keyless server through a name it controls (DNS rebinding)."""
    if settings.allowed_hosts:
        return {h.strip().lower() for h in settings.allowed_hosts if h.strip()}
    if settings.auth_enabled:
        return {"*"}
    bind = _host_name(settings.host)
    names = {*LOCAL_NAMES, bind} - {""}
    if bind in _ANY_ADDRESS:  # every interface: the machine's own names and addresses too
        import socket

        hostname = socket.gethostname()
        names |= {hostname.lower(), socket.getfqdn().lower()}
        try:
            names |= set(socket.gethostbyname_ex(hostname)[2])
        except OSError:
            pass
    return names


class GuardMiddleware:
    """Checks each request before anything parses it.

    Every path: the ``Host`` header against ``allowed_hosts`` (400). ``/v1/...`` (and the
    API description when ``docs`` is ``auth``): 401 without a valid API key, 400 for two
    ``Authorization`` headers, 429 over the per-key rate, 413 for a body over
    ``max_body_bytes``, 408 for a body that does not arrive within ``body_timeout_s``.
    The body is read here and replayed to the app. The caller's cache namespace (one per
    key) goes to ``scope["state"]["namespace"]``.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.namespaces = settings.key_digests()
        self.hosts = accepted_hosts(settings)
        self.metrics_digest = (
            hashlib.sha256(settings.metrics_key.get_secret_value().encode("utf-8")).hexdigest()
            if settings.metrics_key is not None
            else None
        )
        rate = settings.rate_limit_per_minute
        self.buckets = (
            TokenBuckets(rate / 60.0, settings.rate_limit_burst or rate) if rate > 0 else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._host_allowed(scope):
            await _reject(scope, receive, send, 400, "host not allowed", "invalid_host")
            return
        path = scope["path"]
        api = path.startswith("/v1/")
        if path == METRICS_PATH and self.settings.auth_enabled:
            # request and cache counts can tell whether another tenant's question was cached
            problem = self._authenticate(scope, extra=self.metrics_digest)[1]
            if problem:
                await _reject(scope, receive, send, *problem)
                return
        if not api and not (path in DOC_PATHS and self.settings.docs_mode == "auth"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        namespace, problem = self._authenticate(scope)
        if problem:
            await _reject(scope, receive, send, *problem)
            return
        state["namespace"] = namespace
        if namespace != "default":
            state.setdefault("log", {})["namespace"] = namespace
        if api and self.buckets is not None:
            client = scope.get("client") or ("unknown", 0)
            wait = self.buckets.take(namespace if self.settings.auth_enabled else str(client[0]))
            if wait > 0:
                message = f"rate limit of {self.settings.rate_limit_per_minute} requests a minute"
                headers = {"Retry-After": str(max(1, math.ceil(wait)))}
                await _reject(scope, receive, send, 429, message, "rate_limited", headers)
                return
        limit = self.settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _reject(
                scope, receive, send, 413, f"request body over {limit} bytes", "body_too_large"
            )
            return
        if scope["method"] in {"POST", "PUT", "PATCH"}:
            try:
                body = await _read_body(receive, limit, self.settings.body_timeout_s)
            except TimeoutError:
                message = f"request body not received within {self.settings.body_timeout_s:g} s"
                headers = {"Connection": "close"}
                await _reject(scope, receive, send, 408, message, "body_timeout", headers)
                return
            if body is None:  # the client left
                return
            if len(body) > limit:
                await _reject(
                    scope, receive, send, 413, f"request body over {limit} bytes", "body_too_large"
                )
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _host_allowed(self, scope: Scope) -> bool:
        if "*" in self.hosts:
            return True
        values = [v for k, v in scope.get("headers", []) if k.lower() == b"host"]
        if len(values) != 1:
            return False
        host = _host_name(values[0].decode("latin-1"))
        return any(
            host == allowed or (allowed.startswith("*.") and host.endswith(allowed[1:]))
            for allowed in self.hosts
        )

    def _authenticate(
        self, scope: Scope, extra: str | None = None
    ) -> tuple[str, tuple[int, str, str] | None]:
        """The caller's namespace, or the rejection. ``extra``: one more accepted key's
        sha256 (the metrics key), with no namespace of its own."""
        if not self.settings.auth_enabled:
            return "default", None
        values = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if len(values) > 1:  # which one counts is ambiguous: refuse, never pick one
            return "", (
                400,
                "send one Authorization header, not several",
                "duplicate_authorization",
            )
        scheme, _, token = (values[0].decode("latin-1") if values else "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "", (
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                "missing_api_key",
            )
        digest = hashlib.sha256(token.strip().encode("utf-8")).hexdigest()
        found = ""
        for known, namespace in self.namespaces.items():
            if hmac.compare_digest(known, digest):
                found = namespace
        if extra is not None and hmac.compare_digest(extra, digest):
            found = found or "metrics"
        return (found, None) if found else ("", (401, "invalid API key", "invalid_api_key"))


class TokenBuckets:
    """A token bucket per caller: ``burst`` requests at once, refilled at ``rate`` per second.
    At most ``max_callers`` are remembered (the longest idle are forgotten first)."""

    def __init__(self, rate: float, burst: int, max_callers: int = 10_000) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_callers = max_callers
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, last update)

    def take(self, caller: str) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        now = time.monotonic()
        tokens, last = self._buckets.pop(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[caller] = (tokens, now)  # re-inserted: dict order is idle order
        while len(self._buckets) > self.max_callers:
            self._buckets.pop(next(iter(self._buckets)))
        return wait


async def _read_body(receive: Receive, limit: int, timeout_s: float) -> bytes | None:
    """The whole body (stopping once it is over ``limit``), within ``timeout_s`` in all;
    None when the client disconnected. Raises TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body = bytearray()
    more = True
    while more and len(body) <= limit:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError
        message = await asyncio.wait_for(receive(), remaining)
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return bytes(body)


async def _reject(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> None:
    param = {413: "body", 408: "body"}.get(status)
    if code == "invalid_host":
        param = "Host"
    elif code == "duplicate_authorization":
        param = "Authorization"
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    scope.setdefault("state", {}).setdefault("log", {})["error"] = code
    response = JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )
    await response(scope, receive, send)


def _host_name(value: str) -> str:
    """``"Example.com:8000"`` -> ``"example.com"``; ``"[::1]:80"`` -> ``"::1"``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


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
