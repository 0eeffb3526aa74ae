"""Streaming a job to the client: Server-Sent Events, and cancellation when the client leaves."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.answering import record_job
from api.worker import AnswerJob

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, event: str | None = None) -> str:
    """One Server-Sent Event: optional ``event:`` line, one ``data:`` line of JSON (or text)."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class JobStreamingResponse(StreamingResponse):
    """A ``text/event-stream`` response fed by ``job``.

    Starlette cancels the body when the client disconnects; whatever ends the response,
    the job is cancelled here (a no-op once it finished), so the worker stops after its
    current decode step, and the outcome goes into the request's log line.
    """

    def __init__(self, job: AnswerJob, content: AsyncIterator[str], log: dict[str, Any]) -> None:
        self.job = job
        self.log = log
        self.completed = False
        self._content = content
        super().__init__(self._body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _body(self) -> AsyncIterator[str]:
        async for chunk in self._content:
            yield chunk
        self.completed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completed:  # the client left (or sending failed): stop the worker
                self.job.cancel()
            record_job(self.job, self.log, client_gone=not self.completed)
