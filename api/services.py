"""What the app holds while it runs: the engine, its worker and the corpus index."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from api.metrics import ServiceMetrics
from api.settings import Settings
from api.worker import EngineWorker
from ragsnap.engine import RagSnapEngine
from ragsnap.retrieval.bm25 import BM25Index

logger = logging.getLogger("ragsnap.api")


@dataclass
class Services:
    engine: RagSnapEngine
    worker: EngineWorker
    index: BM25Index | None = None

    @property
    def ready(self) -> bool:
        return self.worker.running

    @property
    def model_id(self) -> str:
        return str(self.engine.loaded.model_id)

    def cache_state(self) -> dict[str, Any]:
        """``{"state": "off" | "ok" | "unavailable", "backend": ...}``, without network I/O."""
        store = getattr(self.engine, "store", None)
        if store is None or not getattr(store, "enabled", True):
            return {"state": "off"}
        reachable = bool(getattr(store, "available", True))
        describe = getattr(store, "describe", None)
        backend = describe() if callable(describe) else type(store).__name__
        return {"state": "ok" if reachable else "unavailable", "backend": backend}


def load_engine(settings: Settings) -> RagSnapEngine:
    """Load the model; attach the KV store of ``settings.cache_url`` when the engine takes one."""
    from ragsnap.cache import open_store
    from ragsnap.models import load_model

    loaded = load_model(settings.model, device=settings.device)
    store = open_store(settings.cache_url)
    logger.info("KV cache: %s", store.describe())
    return RagSnapEngine(loaded, store=store)


def start_services(
    settings: Settings, metrics: ServiceMetrics, engine: RagSnapEngine | None
) -> Services:
    """Load (or adopt) the engine, index the corpus when one is configured, start the worker."""
    index = None
    if settings.corpus_dir:
        index = BM25Index.from_directory(settings.corpus_dir)
        logger.info("corpus indexed: %d passages", len(index))
    if engine is None:
        engine = load_engine(settings)
    worker = EngineWorker(
        engine,
        settings.max_queue,
        metrics,
        min_retry_s=settings.retry_after_s,
        max_batch=settings.max_batch,
        step_tokens=settings.step_tokens,
    )
    worker.start()
    return Services(engine=engine, worker=worker, index=index)
