"""Streaming a job to the client: Server-Sent Events, and cancellation when the client leaves.

sse-starlette writes the events and a ``: ping`` comment every ``PING_S`` seconds while
nothing else is sent, so proxies and clients with read timeouts keep a stream open through
a long prefill (a 4K-token prompt takes tens of seconds on a CPU before its first token).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from ragsnap.api.answering import record_job
from ragsnap.api.worker import AnswerJob

PING_S = 15.0


def sse(data: Any, event: str | None = None) -> ServerSentEvent:
    """One Server-Sent Event: optional ``event:`` line, one ``data:`` line of JSON (or text)."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return ServerSentEvent(payload, event=event, sep="\n")


class JobStreamingResponse(EventSourceResponse):
    """A ``text/event-stream`` response fed by ``job``.

    Starlette cancels the body when the client disconnects; whatever ends the response,
    the job is cancelled here (a no-op once it finished), so the worker stops after its
    current decode step, and the outcome goes into the request's log line.
    """

    def __init__(
        self, job: AnswerJob, content: AsyncIterator[ServerSentEvent], log: dict[str, Any]
    ) -> None:
        self.job = job
        self.log = log
        self.completed = False
        self._content = content
        super().__init__(self._body(), ping=PING_S, sep="\n")

    async def _body(self) -> AsyncIterator[ServerSentEvent]:
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
