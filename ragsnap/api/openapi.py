"""What the OpenAPI schema says about responses: the real status codes, the one error body,
and the content types (JSON, Server-Sent Events, Prometheus text)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from ragsnap.api.openapi_limits import state_limits, state_model_limits
from ragsnap.runtime.generation import SEED_MAX, SEED_MIN


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used for every error this service answers."""

    error: ErrorDetail


class ReadyResponse(BaseModel):
    """``/readyz``: ``status`` is ready (200), or loading / failed (503)."""

    model_config = ConfigDict(extra="allow")

    status: str
    model: str | None
    cache: dict[str, Any]


_WHY = {
    400: "bad request (the OpenAI route's invalid input; a Host not allowed; two Authorization headers)",
    401: "missing or wrong API key",
    404: "no such model",
    408: "the request body did not arrive in time",
    413: "body, documents or question over a limit (bytes or tokens)",
    422: "invalid input; `param` names the field",
    429: "the queue is full or the per-key rate is used up; see Retry-After",
    503: "the model is not loaded yet; see Retry-After",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}}},
    429: {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
    503: {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
}
# Server-Sent Events, described one event at a time (``data`` is a JSON document, or
# ``[DONE]`` at the end of an OpenAI stream)
ANSWER_EVENTS = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"enum": ["meta", "token", "citations", "done", "error"]},
                "data": {"type": "string"},
            },
        }
    }
}
CHUNK_EVENTS = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string"}},
        }
    }
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for ``statuses``, each with the error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _WHY[status]}
        if status in _HEADERS:
            entry["headers"] = _HEADERS[status]
        out[status] = entry
    return out


# FastAPI's schema model holds numeric bounds as floats: a signed 64-bit bound comes out as
# +-2**63 written 9.223372036854776e+18, which a reader takes for 9223372036854776000. As
# integers instead, exact: ``maximum`` stays 2**63 (what the schema has always said), with
# ``exclusiveMaximum`` 2**63 stating the bound the server enforces (schemas.Int64)
_INT64_BOUNDS = {
    ("minimum", -(2.0**63)): SEED_MIN,
    ("maximum", 2.0**63): SEED_MAX + 1,
    ("exclusiveMaximum", 2.0**63): SEED_MAX + 1,
}


def _exact_bounds(node: Any) -> None:
    """Write the 64-bit bounds of ``node`` (a schema, changed in place) as integers."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, float) and (key, value) in _INT64_BOUNDS:
                node[key] = _INT64_BOUNDS[key, value]
            else:
                _exact_bounds(value)
    elif isinstance(node, list):
        for item in node:
            _exact_bounds(item)


def install_openapi(app: FastAPI) -> None:
    """Build the schema once; drop FastAPI's automatic 422 (its body is not ours) from the
    operations that never answer 422 (the OpenAI route answers bad input with 400); state
    the server's own limits (:func:`~ragsnap.api.openapi_limits.state_limits`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    body = responses.get("422", {}).get("content", {}).get("application/json", {})
                    if body.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                        del responses["422"]
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            settings = getattr(app.state, "settings", None)
            if settings is not None:  # this server's limits (the app's own settings)
                state_limits(schema, settings)
            services = getattr(app.state, "services", None)
            engine = getattr(services, "engine", None)
            if engine is not None:  # and its model's (a Ray ingress holds none)
                state_model_limits(schema, engine.loaded.model.config.num_hidden_layers)
            _exact_bounds(schema)
            if services is None:  # still loading: the model's limits come with it
                return schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
