"""The answer backend seam: what the routes hand a job to.

The routes build an :class:`ragsnap.api.worker.AnswerJob` and give it to ``Services.worker``, an
:class:`AnswerBackend`. Two backends exist: :class:`ragsnap.api.worker.EngineWorker` (the
scheduler thread of this process) and :class:`ragsnap.api.ray_backend.RayAnswerBackend` (the
engine replicas of a Ray Serve application). Either way the job's events arrive on the
job's own queue, and a refusal is raised by :meth:`AnswerBackend.admit` before any byte
of the response is sent, so 429 and 503 are HTTP statuses in both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ragsnap.api.worker import AnswerJob


class AnswerBackend(Protocol):
    """Runs answer jobs; the routes and ``/readyz`` see nothing else of it."""

    @property
    def running(self) -> bool:
        """Jobs can be admitted."""
        ...

    @property
    def depth(self) -> int:
        """Jobs admitted whose answer has not begun."""
        ...

    @property
    def busy(self) -> bool:
        """Some job is being answered."""
        ...

    async def admit(self, job: AnswerJob) -> None:
        """Take ``job``: raises :class:`ragsnap.api.worker.QueueFullError` (429) or
        :class:`ragsnap.api.worker.WorkerStoppedError` (503) when it cannot."""
        ...

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs and end the running ones."""
        ...
