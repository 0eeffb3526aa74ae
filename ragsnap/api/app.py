"""The FastAPI app, built in one function."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ragsnap.api.errors import install_error_handlers
from ragsnap.api.metrics import ServiceMetrics
from ragsnap.api.middleware import GuardMiddleware, RequestLogMiddleware
from ragsnap.api.openapi import install_openapi
from ragsnap.api.routers import answer, health, openai_compat, playground, search
from ragsnap.api.services import Services, start_services
from ragsnap.api.settings import Settings
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.errors import RagSnapError

logger = logging.getLogger("ragsnap.api")


ServicesFactory = Callable[[Settings, ServiceMetrics], Awaitable[Services]]


def create_app(
    settings: Settings | None = None,
    engine: RagSnapEngine | None = None,
    services_factory: ServicesFactory | None = None,
) -> FastAPI:
    """Build the service.

    With ``engine`` (already loaded) the worker starts with the app; without it the model
    named by ``settings.model`` loads in the background while ``/healthz`` answers and
    ``/readyz`` says 503. Either way one worker thread owns the engine until shutdown.
    ``services_factory`` replaces both: it builds the services (another answer backend,
    such as a Ray Serve ingress's) in the background, with the same 503 until it is done.
    """
    settings = settings or Settings()
    metrics = ServiceMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading: asyncio.Task[Services] | None = None
        if services_factory is not None:
            loading = asyncio.ensure_future(services_factory(settings, metrics))
            loading.add_done_callback(lambda task: _adopt(app, task))
        elif engine is not None:
            app.state.services = start_services(settings, metrics, engine)
        else:
            loading = asyncio.ensure_future(
                asyncio.to_thread(start_services, settings, metrics, None)
            )
            loading.add_done_callback(lambda task: _adopt(app, task))
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            services: Services | None = getattr(app.state, "services", None)
            if services is not None:
                await asyncio.to_thread(services.worker.stop)
                app.state.services = None

    docs = settings.docs_mode != "off"  # "auth": served, behind the API key (GuardMiddleware)
    app = FastAPI(
        title="ragsnap",
        summary="Question answering over documents with a query-aware compressed KV cache",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.services = None
    app.state.load_error = None
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(health.router)
    app.include_router(answer.router)
    app.include_router(openai_compat.router)
    app.include_router(search.router)
    if settings.playground:
        app.include_router(playground.router)
    # added last = outermost: the log line covers the guard's rejections too
    app.add_middleware(GuardMiddleware, settings=settings)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)
    return app


def _adopt(app: FastAPI, task: asyncio.Task[Services]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        app.state.services = task.result()
        logger.info("ready: %s", app.state.services.model_id)
    else:
        # the reason may name server paths: it goes to the log, /readyz only says "failed"
        app.state.load_error = "the model could not be loaded (see the server log)"
        if isinstance(error, RagSnapError):
            logger.error("the model could not be loaded: %s", error.message)
        else:
            logger.error("the model could not be loaded", exc_info=error)
