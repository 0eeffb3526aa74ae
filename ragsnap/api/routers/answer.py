"""``POST /v1/answer``: ragsnap's native endpoint (typed Server-Sent Events, or one JSON object)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from sse_starlette import ServerSentEvent

from ragsnap.api.answering import (
    answer_options,
    chat_context,
    check_question,
    check_tokens,
    collect_answer,
    record_job,
    resolve_documents,
    submit_job,
)
from ragsnap.api.deps import NamespaceDep, RequestLogDep, ServicesDep, SettingsDep
from ragsnap.api.errors import error_body
from ragsnap.api.openapi import ANSWER_EVENTS, errors
from ragsnap.api.schemas import AnswerRequest, AnswerResponse
from ragsnap.api.streaming import JobStreamingResponse, sse
from ragsnap.api.worker import AnswerJob, JobFailure
from ragsnap.engine.events import event_payload
from ragsnap.prompt.assembly import Turn

router = APIRouter(tags=["answer"])


async def answer_events(job: AnswerJob) -> AsyncIterator[ServerSentEvent]:
    """``meta``, ``token``..., ``citations``, ``done``; or ``error`` and the end of the stream."""
    async for item in job.stream():
        if isinstance(item, JobFailure):
            yield sse(error_body(item.status, item.message, item.param, item.code), event="error")
            return
        yield sse(event_payload(item), event=item.type)


@router.post(
    "/v1/answer",
    response_model=AnswerResponse,
    response_model_exclude_unset=True,  # kept_tokens only when asked for
    responses={
        200: {
            "content": ANSWER_EVENTS,
            "description": "the answer (JSON), or its events (stream: true)",
        },
        **errors(400, 401, 408, 413, 422, 429, 503),
    },
)
async def answer(
    body: AnswerRequest,
    request: Request,
    services: ServicesDep,
    settings: SettingsDep,
    namespace: NamespaceDep,
    log: RequestLogDep,
) -> AnswerResponse | JobStreamingResponse:
    question = check_question(body.question, settings)
    documents = resolve_documents(body, services, settings)
    check_tokens(question, documents, services, settings)
    options = answer_options(
        body.compression,
        settings,
        max_new_tokens=body.max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop,
        chat=chat_context(
            body.instructions,
            [Turn(t.role, t.content) for t in body.history or []],
            settings,
        ),
        citations=body.citations,
        kept_tokens=body.kept_tokens,
        document_order=body.document_order,
        unsupported=body.unsupported,
    )
    log["stream"] = body.stream
    job = await submit_job(services, question, documents, options, namespace, log)
    if body.stream:
        return JobStreamingResponse(job, answer_events(job), log)
    try:
        meta, done = await collect_answer(job, request)
    finally:
        record_job(job, log)
    payload = event_payload(done)
    return AnswerResponse(meta=event_payload(meta), **payload)
