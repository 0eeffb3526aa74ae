"""The ingress side of Ray Serve: jobs answered by the engine deployment's replicas.

:class:`RayAnswerBackend` is an :class:`ragsnap.api.backend.AnswerBackend`. ``admit`` opens a
streaming call on the engine deployment (routed by :mod:`ragsnap.api.ray_router` on the job's
document set) and waits for the replica's first message, its :class:`Admission`: a full
replica queue is a 429 and no ready replica within ``admit_timeout_s`` is a 503, both
before the response starts, as in-process. The replica's events are then relayed to the
job's queue by one task per job. Cancelling the job (the client went away) cancels that
task, which cancels the streaming call: Ray Serve cancels the replica's generator, which
cancels the replica's own job. A replica that dies before it sent anything is replaced by
another for the same request; after that the stream gets a 503 ``error`` event and ends.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ragsnap.api.metrics import ServiceMetrics
from ragsnap.api.worker import AnswerJob, JobFailure, QueueFullError, WorkerStoppedError
from ragsnap.cache.keys import canonical_digest
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import AnswerEvent, DoneEvent
from ragsnap.prompt.documents import Document

logger = logging.getLogger("ragsnap.api.ray")

REPLICA_GONE_MESSAGE = "the replica answering this request stopped; retry the request"


@dataclass
class RemoteAnswer:
    """What a replica needs of a job (the job itself holds an event loop and locks)."""

    request_id: str
    question: str
    documents: list[Document]
    options: AnswerOptions
    namespace: str

    @classmethod
    def of(cls, job: AnswerJob) -> RemoteAnswer:
        return cls(job.request_id, job.question, list(job.documents), job.options, job.namespace)


@dataclass
class Admission:
    """A replica's first message: the job is queued there, or why not."""

    accepted: bool
    replica: str
    status: int = 200
    retry_after_s: int = 0


def route_key(namespace: str, documents: list[Document]) -> str:
    """The affinity key: the caller's namespace and the ORDERED document content hashes
    (what the document-prefix cache entries are keyed on besides the model)."""
    return canonical_digest(
        {"namespace": namespace, "documents": [d.content_hash for d in documents]}
    )


def _replica_gone() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)


class RayAnswerBackend:
    """Relays jobs to the engine deployment behind ``handle`` (a ``DeploymentHandle``)."""

    def __init__(
        self,
        handle: Any,
        metrics: ServiceMetrics,
        *,
        admit_timeout_s: float = 30.0,
        retries: int = 2,
    ) -> None:
        self._handle = handle.options(stream=True, method_name="answer")
        self.metrics = metrics
        self.admit_timeout_s = admit_timeout_s
        self.retries = retries
        self._loop = asyncio.get_running_loop()
        self._jobs: dict[int, AnswerJob] = {}  # by id(): jobs are not hashable
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False
        metrics.track_queue(lambda: self.depth, lambda: float(self.answering))

    @property
    def running(self) -> bool:
        return not self._stopped

    @property
    def depth(self) -> int:
        return sum(1 for job in self._jobs.values() if job.started_at is None)

    @property
    def answering(self) -> int:
        return sum(1 for job in self._jobs.values() if job.started_at is not None)

    @property
    def busy(self) -> bool:
        return self.answering > 0

    async def admit(self, job: AnswerJob) -> None:
        if self._stopped:
            raise WorkerStoppedError("the ingress is shutting down")
        request = RemoteAnswer.of(job)
        key = route_key(job.namespace, request.documents)
        stream = await self._open(request, key)
        job.metrics = self.metrics
        self._jobs[id(job)] = job
        task = asyncio.ensure_future(self._relay(job, stream, request, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        job.on_cancel = lambda: self._loop.call_soon_threadsafe(task.cancel)

    async def _open(self, request: RemoteAnswer, key: str) -> Any:
        """A streaming call whose replica accepted the job (retried on a dead replica)."""
        unavailable: tuple[type[BaseException], ...] = (StopAsyncIteration, *_replica_gone())
        for _ in range(self.retries + 1):
            stream = self._handle.remote(request, route_key=key)
            try:
                first = await asyncio.wait_for(stream.__anext__(), self.admit_timeout_s)
            except TimeoutError:
                stream.cancel()
                raise WorkerStoppedError("no engine replica is ready") from None
            except asyncio.CancelledError:  # the client left while the request was routed
                stream.cancel()
                raise
            except unavailable as exc:
                logger.warning("replica unavailable for request %s: %r", request.request_id, exc)
                stream.cancel()
                continue
            if not isinstance(first, Admission):
                stream.cancel()
                raise RuntimeError(f"unexpected first message from a replica: {first!r}")
            if first.accepted:
                return stream
            if first.status == 429:
                self.metrics.rejected.inc()
                raise QueueFullError(first.retry_after_s)
            raise WorkerStoppedError(f"replica {first.replica} is not accepting answers")
        raise WorkerStoppedError("no engine replica could take the request")

    async def _relay(self, job: AnswerJob, stream: Any, request: RemoteAnswer, key: str) -> None:
        gone = _replica_gone()
        outcome, relayed = "cancelled", False
        try:
            while True:
                try:
                    async for items in stream:
                        for item in items:
                            outcome = self._forward(job, item, outcome)
                        relayed = True
                    break
                except gone as exc:
                    if relayed:
                        logger.warning("replica died during request %s: %r", job.request_id, exc)
                        job.relay(JobFailure(503, REPLICA_GONE_MESSAGE, code="replica_failed"))
                        outcome = "error"
                        break
                    try:  # nothing reached the client yet: the same request on another replica
                        stream = await self._open(request, key)
                    except (QueueFullError, WorkerStoppedError):
                        job.relay(JobFailure(503, REPLICA_GONE_MESSAGE, code="replica_failed"))
                        outcome = "error"
                        break
            if outcome == "cancelled" and not job.is_cancelled():
                # the replica's stream ended without an answer nobody asked it to stop
                job.relay(JobFailure(503, REPLICA_GONE_MESSAGE, code="replica_failed"))
                outcome = "error"
        except asyncio.CancelledError:
            stream.cancel()
        except Exception as exc:
            logger.error("relaying request %s failed", job.request_id, exc_info=exc)
            job.relay(JobFailure(500, "the answer failed on the server", code="internal_error"))
            outcome = "error"
        finally:
            self._jobs.pop(id(job), None)
            job.close(outcome)

    @staticmethod
    def _forward(job: AnswerJob, item: AnswerEvent | JobFailure, outcome: str) -> str:
        if job.started_at is None:
            job.started()
        job.relay(item)
        if isinstance(item, JobFailure):
            return "error"
        if isinstance(item, DoneEvent):
            return "ok"
        return outcome

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs; cancel the relays (and so the replicas' answers)."""
        self._stopped = True
        for task in list(self._tasks):
            self._loop.call_soon_threadsafe(task.cancel)
