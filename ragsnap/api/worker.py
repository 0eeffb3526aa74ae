"""The engine worker: a continuous-batching scheduler thread owns the model.

Requests never touch the engine; they submit an :class:`AnswerJob` and read its events
from an asyncio queue fed by the scheduler thread (``ragsnap.engine.scheduler``), which decodes
up to ``max_batch`` jobs together and prefills the next one in chunks between their steps.
The wait queue is bounded: a full queue refuses the job at once (the route answers 429).
A job whose client went away is cancelled: skipped if still waiting, stopped at the next
prefill chunk or decode step if running.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragsnap.api.metrics import ServiceMetrics
from ragsnap.engine.config import DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.engine.events import AnswerEvent, DoneEvent
from ragsnap.engine.scheduler import Scheduler
from ragsnap.engine.stats import AnswerStats
from ragsnap.engine.stopping import StopFilter
from ragsnap.errors import KVMemoryError, RagSnapError
from ragsnap.prompt.documents import Document

logger = logging.getLogger("ragsnap.api.worker")


class QueueFullError(Exception):
    """The wait queue is full; ``retry_after_s`` estimates when a slot frees up."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("the answer queue is full")
        self.retry_after_s = retry_after_s


class WorkerStoppedError(Exception):
    """The worker is not running (not started yet, or shutting down)."""


@dataclass
class JobFailure:
    """What the worker sends instead of more events when the answer failed."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


_END = object()


@dataclass
class AnswerJob:
    """One answer to compute, and the channel its events travel back on."""

    request_id: str
    question: str
    documents: Sequence[Document]
    options: AnswerOptions
    namespace: str = "default"
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    accepted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    outcome: str = "queued"
    new_tokens: int = 0
    stats: AnswerStats | None = None

    metrics: ServiceMetrics | None = None
    on_close: Any = None  # called with the job when it ends (the worker's job-time average)
    on_cancel: Any = None  # called once when cancelled (a remote backend stops its call)
    _stopper: StopFilter | None = None

    def __post_init__(self) -> None:
        if self.options.generation.stop:  # stop strings: the answer is cut as it streams
            self._stopper = StopFilter(self.options.generation.stop)

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    # -- the scheduler's side (``ragsnap.engine.scheduler.Request``) ---------------------------

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()

    def started(self) -> None:
        self.started_at = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_wait.observe(self.started_at - self.accepted_at)

    def should_stop(self, tokens: list[int]) -> bool:
        """The decoder ends this row (normally: citations and ``done`` follow) once a stop
        string matched."""
        return self._stopper is not None and self._stopper.matched is not None

    def emit(self, event: AnswerEvent) -> None:
        if self._stopper is not None:
            for piece in self._stopper.push(event):
                self._emit(piece)
        else:
            self._emit(event)

    def relay(self, item: AnswerEvent | JobFailure) -> None:
        """An event (or failure) computed elsewhere (a Ray Serve replica): its stop strings
        were applied there."""
        if isinstance(item, JobFailure):
            self._send(item)
        else:
            self._emit(item)

    def _emit(self, event: AnswerEvent) -> None:
        if event.type == "token":
            self.new_tokens += 1
        if isinstance(event, DoneEvent):
            self.stats = event.stats
            if self.metrics is not None:
                self.metrics.observe_answer(event.stats)
        self._send(event)

    def fail(self, error: Exception) -> None:
        if isinstance(error, KVMemoryError):
            self._send(JobFailure(413, error.message, param=error.field, code="kv_memory"))
        elif isinstance(error, RagSnapError):
            self._send(JobFailure(422, error.message, param=error.field, code="invalid_value"))
        else:
            logger.error("answer failed (request %s)", self.request_id, exc_info=error)
            self._send(JobFailure(500, "the answer failed on the server", code="internal_error"))
        self.close("error")

    def close(self, outcome: str) -> None:
        self.outcome = outcome
        if self.metrics is not None:
            label = "skipped" if outcome == "cancelled" and self.started_at is None else outcome
            self.metrics.answers.labels(label).inc()
        if self.on_close is not None:
            self.on_close(self)
        self._send(_END)

    def _send(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            self.cancelled.set()

    async def stream(self) -> AsyncIterator[AnswerEvent | JobFailure]:
        """The job's events as they come; ends after ``done``, a failure or a cancellation."""
        while True:
            item = await self.events.get()
            if item is _END:
                return
            yield item

    async def batches(self) -> AsyncIterator[list[AnswerEvent | JobFailure]]:
        """:meth:`stream` in lists: each waits for one item, then takes every item already
        queued (a remote caller then pays its per-message cost once per list)."""
        while True:
            batch = [await self.events.get()]
            while batch[-1] is not _END and not self.events.empty():
                batch.append(self.events.get_nowait())
            ended = batch[-1] is _END
            items = [item for item in batch if item is not _END]
            if items:
                yield items
            if ended:
                return

    @property
    def queue_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.accepted_at


class EngineWorker:
    """Runs jobs on ``engine`` through a :class:`Scheduler`; at most ``max_queue`` live jobs wait.

    A waiting job whose client left stops counting against the limit at once (it is
    dropped when the scheduler reaches it), so a disconnect frees its slot immediately.
    ``max_batch`` jobs decode together (1: one at a time); ``step_tokens`` is the token
    budget of one scheduler step (a prefill chunk plus one token per running job);
    ``prefill_threads`` and ``decode_threads`` the torch threads prompts prefill and rows
    decode on (None: the scheduler's own).
    """

    def __init__(
        self,
        engine: RagSnapEngine,
        max_queue: int,
        metrics: ServiceMetrics,
        min_retry_s: int = 1,
        max_batch: int = DEFAULT_MAX_BATCH,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        prefill_threads: int | None = None,
        decode_threads: int | None = None,
        kv_memory_bytes: int | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.min_retry_s = min_retry_s
        self.scheduler = Scheduler(
            engine,
            max_batch=max_batch,
            step_tokens=step_tokens,
            prefill_threads=prefill_threads,
            decode_threads=decode_threads,
            kv_memory_bytes=kv_memory_bytes,
        )
        self.scheduler.stats.on_step = metrics.observe_step
        self.scheduler.stats.on_group = metrics.observe_group
        self._lock = threading.Lock()
        self._mean_job_s = 5.0  # refined by an exponential moving average of real jobs
        metrics.track_queue(
            lambda: self.depth,
            lambda: float(self.scheduler.running),
            lambda: float(self.scheduler.pending_writes),
            lambda: float(self.scheduler.kv_bytes_in_use()),
            kv_memory_bytes,
            lambda: float(self.scheduler.tier_bytes_in_use()),
        )

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse waiting jobs (503), cancel the running ones after their step, join."""
        for job in self.scheduler.stop(timeout):
            assert isinstance(job, AnswerJob)
            job.cancel()
            job._send(JobFailure(503, "the server is shutting down", code="shutting_down"))
            job._send(_END)

    @property
    def running(self) -> bool:
        return self.scheduler.alive

    @property
    def depth(self) -> int:
        """Jobs waiting whose client is still there."""
        return sum(1 for job in self.scheduler.waiting() if not job.is_cancelled())

    @property
    def busy(self) -> bool:
        return self.scheduler.running > 0

    # -- submitting ----------------------------------------------------------------

    def submit(self, job: AnswerJob) -> None:
        """Queue ``job``; raises :class:`QueueFullError` at once when no slot is free."""
        if not self.running:
            raise WorkerStoppedError("the engine worker is not running")
        with self._lock:
            live = self.depth
            if live >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFullError(self._retry_after(live))
            job.metrics, job.on_close = self.metrics, self._job_ended
            self.scheduler.submit(job)

    async def admit(self, job: AnswerJob) -> None:
        """:meth:`submit`, as the :class:`ragsnap.api.backend.AnswerBackend` seam calls it."""
        self.submit(job)

    def _retry_after(self, waiting: int) -> int:
        """Seconds until a slot is likely free: the waiting jobs share the batch."""
        batches = math.ceil((waiting + 1) / self.scheduler.max_batch)
        return max(self.min_retry_s, math.ceil(self._mean_job_s * batches))

    def _job_ended(self, job: AnswerJob) -> None:
        if job.started_at is not None:
            elapsed = time.perf_counter() - job.started_at
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed
