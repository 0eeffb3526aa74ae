"""The engine worker: one thread owns the model and answers queued jobs one at a time.

Requests never touch the engine; they submit an :class:`AnswerJob` and read its events
from an asyncio queue fed by the worker thread. The wait queue is bounded: a full queue
refuses the job at once (the route answers 429). A job whose client went away is
cancelled: skipped if still waiting, stopped after the current decode step if running.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from api.metrics import ServiceMetrics
from ragsnap.documents import Document
from ragsnap.engine import AnswerOptions, RagSnapEngine
from ragsnap.errors import RagSnapError
from ragsnap.events import AnswerEvent, DoneEvent
from ragsnap.stopping import stream_answer

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
    stats: dict[str, Any] = field(default_factory=dict)

    def cancel(self) -> None:
        self.cancelled.set()

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

    @property
    def queue_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.accepted_at


class EngineWorker:
    """Runs jobs on ``engine`` in one thread; at most ``max_queue`` live jobs wait.

    A waiting job whose client left stops counting against the limit at once (it is
    dropped when the worker reaches it), so a disconnect frees its slot immediately.
    """

    def __init__(
        self, engine: RagSnapEngine, max_queue: int, metrics: ServiceMetrics, min_retry_s: int = 1
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.min_retry_s = min_retry_s
        self._waiting: deque[AnswerJob] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._busy = threading.Event()
        self._current: AnswerJob | None = None
        self._mean_job_s = 5.0  # refined by an exponential moving average of real jobs
        metrics.track_queue(lambda: self.depth, lambda: 1.0 if self._busy.is_set() else 0.0)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ragsnap-engine-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse waiting jobs (503), stop the running one after its decode step, join."""
        if self._thread is None:
            return
        with self._changed:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            self._changed.notify_all()
        if self._current is not None:
            self._current.cancel()
        for job in waiting:
            job.cancel()
            job._send(JobFailure(503, "the server is shutting down", code="shutting_down"))
            job._send(_END)
        self._thread.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def depth(self) -> int:
        """Jobs waiting whose client is still there."""
        with self._changed:
            return sum(1 for job in self._waiting if not job.cancelled.is_set())

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    # -- submitting ----------------------------------------------------------------

    def submit(self, job: AnswerJob) -> None:
        """Queue ``job``; raises :class:`QueueFullError` at once when no slot is free."""
        if not self.running:
            raise WorkerStoppedError("the engine worker is not running")
        with self._changed:
            live = sum(1 for waiting in self._waiting if not waiting.cancelled.is_set())
            if live >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFullError(self._retry_after(live))
            self._waiting.append(job)
            self._changed.notify()

    def _retry_after(self, waiting: int) -> int:
        """Seconds until a slot is likely free: the running job and the waiting ones."""
        return max(self.min_retry_s, math.ceil(self._mean_job_s * (waiting + 1)))

    # -- the thread ----------------------------------------------------------------

    def _next_job(self) -> AnswerJob | None:
        with self._changed:
            while not self._waiting and not self._stopping:
                self._changed.wait()
            return None if self._stopping else self._waiting.popleft()

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                job.outcome = "cancelled"
                self.metrics.answers.labels("skipped").inc()
                job._send(_END)
                continue
            self._busy.set()
            self._current = job
            try:
                self._answer(job)
            finally:
                self._current = None
                self._busy.clear()
                job._send(_END)

    def _answer(self, job: AnswerJob) -> None:
        job.started_at = time.perf_counter()
        self.metrics.queue_wait.observe(job.started_at - job.accepted_at)
        events: Generator[AnswerEvent, None, None] = stream_answer(  # type: ignore[assignment]
            self.engine,
            job.question,
            job.documents,
            job.options,
            should_stop=job.cancelled.is_set,
            namespace=job.namespace,
        )
        try:
            for event in events:
                if job.cancelled.is_set():
                    break
                if event.type == "token":
                    job.new_tokens += 1
                if isinstance(event, DoneEvent):
                    job.stats = event.stats
                    self.metrics.observe_answer(event.stats)
                job._send(event)
            job.outcome = "cancelled" if job.cancelled.is_set() else "ok"
        except RagSnapError as exc:
            job.outcome = "error"
            job._send(JobFailure(422, exc.message, param=exc.field, code="invalid_value"))
        except Exception:
            job.outcome = "error"
            logger.exception("answer failed (request %s)", job.request_id)
            job._send(JobFailure(500, "the answer failed on the server", code="internal_error"))
        finally:
            events.close()  # stops generation at once when we left the loop early
            elapsed = time.perf_counter() - job.started_at
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed
            self.metrics.answers.labels(job.outcome).inc()
