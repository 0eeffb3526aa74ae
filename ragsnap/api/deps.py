"""Request dependencies as ``Annotated`` aliases: the service objects and the caller's namespace."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ragsnap.api.errors import ApiError
from ragsnap.api.metrics import ServiceMetrics
from ragsnap.api.services import Services
from ragsnap.api.settings import Settings


def get_services(request: Request) -> Services:
    """The running services; 503 (with ``Retry-After``) until the model is loaded."""
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None or not services.ready:
        raise ApiError(
            503, "the model is not loaded yet", code="not_ready", headers={"Retry-After": "5"}
        )
    return services


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


def get_namespace(request: Request) -> str:
    """The caller's cache namespace, set by :class:`ragsnap.api.middleware.GuardMiddleware` after
    it checked the API key (one namespace per key; ``default`` when keys are off)."""
    return str(request.scope.get("state", {}).get("namespace", "default"))


def request_log(request: Request) -> dict[str, object]:
    """The fields the access log line of this request will carry (no request text)."""
    log: dict[str, object] = request.scope.setdefault("state", {}).setdefault("log", {})
    return log


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
NamespaceDep = Annotated[str, Depends(get_namespace)]
RequestLogDep = Annotated[dict[str, object], Depends(request_log)]
