"""``/healthz`` (the process answers), ``/readyz`` (model loaded, cache state), ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ragsnap.api.deps import MetricsDep
from ragsnap.api.openapi import ReadyResponse
from ragsnap.api.services import Services

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=ReadyResponse,
    responses={503: {"model": ReadyResponse, "description": "loading, or the load failed"}},
)
async def readyz(request: Request) -> JSONResponse:
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None or not services.ready:
        error = getattr(request.app.state, "load_error", None)
        body: dict[str, Any] = {
            "status": "failed" if error else "loading",
            "model": None,
            "cache": {"state": "unknown"},
        }
        if error:
            body["error"] = error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    body = {
        "status": "ready",
        "model": services.model_id,
        "device": services.device,
        # the ping may wait for its timeout: off the event loop
        "cache": await asyncio.to_thread(services.cache_state),
        "corpus_passages": len(services.index) if services.index is not None else None,
        "queue": {"waiting": services.worker.depth, "busy": services.worker.busy},
    }
    return JSONResponse(body)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(registry: MetricsDep) -> Response:
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)
