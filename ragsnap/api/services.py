"""What the app holds while it runs: the answer backend, the model's identity and tokenizer,
the KV store and the corpus index.

In-process the backend is an :class:`EngineWorker` around the loaded engine; on a Ray
Serve ingress it is the engine deployment's handle (``engine`` is None there: the ingress
holds the replicas' tokenizer, for the token limits, and no model).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ragsnap.api.backend import AnswerBackend
from ragsnap.api.metrics import ServiceMetrics
from ragsnap.api.settings import Settings
from ragsnap.api.worker import EngineWorker
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.retrieval.bm25 import BM25Index
from ragsnap.runtime.threads import available_cores, in_a_passing_thread

logger = logging.getLogger("ragsnap.api")

_PING_TIMEOUT_S = 0.5


@dataclass
class Services:
    engine: RagSnapEngine | None
    worker: AnswerBackend
    index: BM25Index | None = None
    ping_every_s: float = 1.5
    tokenizer: Any = None  # the engine's, unless given
    model_id: str = ""  # the engine's, unless given
    device: str = ""  # the engine's, unless given
    store: Any = None  # the engine's KV store, unless given
    _ping: tuple[float, bool] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.engine is not None:
            if self.tokenizer is None:
                self.tokenizer = self.engine.tokenizer
            if self.store is None:
                self.store = getattr(self.engine, "store", None)
            self.model_id = self.model_id or str(self.engine.loaded.model_id)
            self.device = self.device or str(self.engine.device)

    @property
    def ready(self) -> bool:
        return self.worker.running

    def cache_state(self) -> dict[str, Any]:
        """``{"state": "off" | "ok" | "unavailable", "backend": ...}``: the store is asked
        (a ping with a short timeout) at most once per ``ping_every_s``; the backend is
        named without credentials or server paths."""
        store = self.store
        if store is None or not getattr(store, "enabled", True):
            return {"state": "off"}
        now = time.monotonic()
        if self._ping is None or now - self._ping[0] >= self.ping_every_s:
            self._ping = (now, bool(store.ping(_PING_TIMEOUT_S)))
        return {"state": "ok" if self._ping[1] else "unavailable", "backend": store.public_name()}


def load_engine(settings: Settings) -> RagSnapEngine:
    """Open the KV store ``settings`` name, then load the model and build the engine on them."""
    from ragsnap.cache import open_store

    # the store first: a bad cache URL fails in a second, not after the model has loaded
    store = open_store(settings.cache_url, key=settings.cache_secret)
    logger.info("KV cache: %s", store.describe())
    return RagSnapEngine.from_config(settings, store=store)


def start_services(
    settings: Settings, metrics: ServiceMetrics, engine: RagSnapEngine | None
) -> Services:
    """Load (or adopt) the engine, index the corpus when one is configured, start the worker."""
    index = None
    if settings.corpus_dir:
        index = BM25Index.from_directory(settings.corpus_dir)
        logger.info("corpus indexed: %d passages", len(index))
    if engine is None:  # see ragsnap.cli.serve: this thread keeps no OpenMP team
        engine = in_a_passing_thread(lambda: load_engine(settings))
    store = engine.store
    if store is not None:
        metrics.track_rejections(lambda: dict(store.rejections))
    worker = EngineWorker(
        engine,
        settings.max_queue,
        metrics,
        min_retry_s=settings.retry_after_s,
        max_batch=settings.max_batch,
        step_tokens=settings.step_tokens,
        prefill_threads=settings.prefill_threads or available_cores(),
        decode_threads=settings.decode_threads,
        kv_memory_bytes=settings.kv_memory_bytes,
    )
    # batch memory for the prefix hits finished together: as many as the KV memory admits
    rows = worker.scheduler.prefix_hit_rows(settings.reserve_prefix_tokens)
    reserved = engine.reserve_prefix_hits(rows, settings.reserve_prefix_tokens)
    if reserved:
        logger.info(
            "reserved %.0f MiB for %d prefix hits of up to %d tokens",
            reserved / 2**20,
            rows,
            settings.reserve_prefix_tokens,
        )
    worker.start()
    return Services(
        engine=engine, worker=worker, index=index, ping_every_s=settings.cache_ping_interval_s
    )
