"""The Ray Serve application: an ingress serving the FastAPI app, and engine replicas.

- :class:`EngineReplica` (``num_replicas`` of them): loads the engine named by the
  settings, runs one :class:`ragsnap.api.worker.EngineWorker` (its continuous-batching scheduler)
  and streams each job's events back from :meth:`EngineReplica.answer`. Every replica
  opens the same ``cache_url``: with ``redis://`` they share one KV cache.
- :class:`Ingress`: the very app of ``ragsnap serve`` (routes, auth, limits, errors, SSE,
  metrics) from :func:`ragsnap.api.app.create_app`, with a :class:`ragsnap.api.ray_backend.RayAnswerBackend`
  as its answer backend; the replicas' tokenizer travels to it once, for the token limits.
- :func:`build_app`: the application builder ``serve run`` imports
  (``import_path: ragsnap.api.ray_app:build_app`` in ``deploy/serve.yaml``), with
  :class:`RayAppArgs` as its arguments; ``ragsnap serve --ray`` calls it too.

Settings reach the replicas as the ``settings`` overrides of the arguments, on top of the
``RAGSNAP_`` environment of each replica's process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import ray
from fastapi import FastAPI
from pydantic import BaseModel, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from ragsnap.api.app import create_app
from ragsnap.api.metrics import ServiceMetrics
from ragsnap.api.ray_backend import Admission, RayAnswerBackend, RemoteAnswer
from ragsnap.api.services import Services, start_services
from ragsnap.api.settings import Settings
from ragsnap.api.worker import (
    AnswerJob,
    EngineWorker,
    JobFailure,
    QueueFullError,
    WorkerStoppedError,
)
from ragsnap.engine.events import AnswerEvent, DoneEvent

logger = logging.getLogger("ragsnap.api.ray")

ROUTER_CLASS = "ragsnap.api.ray_router:DocumentSetRouter"


class RayAppArgs(BaseModel):
    """The arguments of :func:`build_app` (the ``args:`` of a Serve config)."""

    replicas: int = Field(default=2, ge=1, description="engine replicas")
    replica_cpus: float = Field(default=1.0, gt=0, description="CPUs reserved per replica")
    replica_gpus: float | None = Field(
        default=None, ge=0, description="GPUs per replica (unset: 1 when the cluster has GPUs)"
    )
    ingress_cpus: float = Field(default=0.25, gt=0)
    max_ongoing_requests: int | None = Field(
        default=None, ge=1, description="per replica (unset: max_queue + max_batch + 8)"
    )
    admit_timeout_s: float = Field(default=30.0, gt=0, description="no replica in time: 503")
    settings: dict[str, Any] = Field(default_factory=dict, description="Settings overrides")


@serve.deployment(name="EngineReplica", graceful_shutdown_timeout_s=30)
class EngineReplica:
    """One engine and its scheduler; :meth:`answer` streams a job's events."""

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        self.settings = Settings(**(settings or {}))
        self.services = start_services(self.settings, ServiceMetrics(), None)
        self.worker = cast(EngineWorker, self.services.worker)
        self.cancelled = 0  # answers whose caller left before their end
        self.replica = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s ready: %s", self.replica, self.services.model_id)

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to know: the model and its tokenizer."""
        return {
            "model_id": self.services.model_id,
            "device": self.services.device,
            "tokenizer": self.services.tokenizer,
        }

    def load(self, route_key: str = "") -> dict[str, Any]:
        """This replica's name and queue (``route_key`` routes the call as an answer's)."""
        return {
            "replica": self.replica,
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "waiting": self.worker.depth,
            "answering": self.worker.scheduler.running,
            "cancelled": self.cancelled,
        }

    async def answer(
        self, request: RemoteAnswer, route_key: str = ""
    ) -> AsyncIterator[Admission | list[AnswerEvent | JobFailure]]:
        """An :class:`Admission`, then (when accepted) the job's events or its failure, in
        lists of those ready together: one Ray message per list, not per token, when
        decoding outpaces the network. Closing the stream (Ray Serve cancels it when the
        caller does) cancels the job."""
        job = AnswerJob(
            request_id=request.request_id,
            question=request.question,
            documents=request.documents,
            options=request.options,
            namespace=request.namespace,
        )
        try:
            self.worker.submit(job)
        except QueueFullError as exc:
            yield Admission(False, self.replica, 429, exc.retry_after_s)
            return
        except WorkerStoppedError:
            yield Admission(False, self.replica, 503, 5)
            return
        yield Admission(True, self.replica)
        ended = False
        try:
            async for items in job.batches():
                for item in items:
                    if isinstance(item, DoneEvent):
                        item.stats.replica = self.replica
                yield items
            ended = True
        finally:
            if not ended:  # the caller cancelled the stream: stop the answer
                self.cancelled += 1
                job.cancel()

    def check_health(self) -> None:
        if not self.worker.running:
            raise RuntimeError("the engine worker stopped")

    def __del__(self) -> None:
        services = getattr(self, "services", None)
        if services is not None:
            services.worker.stop(10.0)  # waiting jobs get a 503 event, running ones stop


async def ingress_services(
    handle: DeploymentHandle, settings: Settings, metrics: ServiceMetrics, admit_timeout_s: float
) -> Services:
    """Services of an ingress: the replicas' model and tokenizer, the shared store (for
    ``/readyz``), the corpus, and the Ray backend. Waits for a first replica."""
    from ragsnap.cache import open_store
    from ragsnap.retrieval.bm25 import BM25Index

    info = await handle.describe.remote()
    secret = settings.cache_key.get_secret_value() if settings.cache_key is not None else ""
    index = BM25Index.from_directory(settings.corpus_dir) if settings.corpus_dir else None
    return Services(
        engine=None,
        worker=RayAnswerBackend(handle, metrics, admit_timeout_s=admit_timeout_s),
        index=index,
        ping_every_s=settings.cache_ping_interval_s,
        tokenizer=info["tokenizer"],
        model_id=info["model_id"],
        device=info["device"],
        store=open_store(settings.cache_url, key=secret),
    )


@serve.deployment(name="Ingress", max_ongoing_requests=1024)
@serve.ingress()
class Ingress:
    """The FastAPI app of ``ragsnap serve`` in front of the engine deployment."""

    def __init__(
        self,
        engine: DeploymentHandle,
        settings: dict[str, Any] | None = None,
        admit_timeout_s: float = 30.0,
    ) -> None:
        self._engine = engine
        self._settings = Settings(**(settings or {}))
        self._admit_timeout_s = admit_timeout_s

    def __serve_build_asgi_app__(self) -> FastAPI:
        async def factory(settings: Settings, metrics: ServiceMetrics) -> Services:
            return await ingress_services(self._engine, settings, metrics, self._admit_timeout_s)

        return create_app(self._settings, services_factory=factory)


def build_app(args: dict[str, Any] | RayAppArgs | None = None) -> serve.Application:
    """The application: ``Ingress`` bound to ``replicas`` ``EngineReplica`` s."""
    config = args if isinstance(args, RayAppArgs) else RayAppArgs(**(args or {}))
    settings = Settings(**config.settings)
    gpus = config.replica_gpus
    if gpus is None:
        gpus = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    ongoing = config.max_ongoing_requests or settings.max_queue + settings.max_batch + 8
    engine = (
        cast(serve.Deployment, EngineReplica)
        .options(
            num_replicas=config.replicas,
            ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": gpus},
            # a streamed answer holds its slot to the end: Ray's default (5) would queue
            # requests at the router, before the replica's own queue could answer 429
            max_ongoing_requests=ongoing,
            request_router_config={"request_router_class": ROUTER_CLASS},
        )
        # a replica prefills on the CPUs it reserves, not on every core of its node
        .bind({"prefill_threads": max(1, int(config.replica_cpus)), **config.settings})
    )
    ingress = cast(serve.Deployment, Ingress).options(
        ray_actor_options={"num_cpus": config.ingress_cpus}
    )
    return ingress.bind(engine, config.settings, config.admit_timeout_s)
