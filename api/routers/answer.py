"""``POST /v1/answer``: ragsnap's native endpoint (typed Server-Sent Events, or one JSON object)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from api.answering import (
    answer_options,
    check_question,
    collect_answer,
    event_payload,
    record_job,
    resolve_documents,
    submit_job,
)
from api.deps import NamespaceDep, RequestLogDep, ServicesDep, SettingsDep
from api.errors import error_body
from api.schemas import AnswerRequest, AnswerResponse
from api.streaming import JobStreamingResponse, sse
from api.worker import AnswerJob, JobFailure

router = APIRouter(tags=["answer"])


async def answer_events(job: AnswerJob) -> AsyncIterator[str]:
    """``meta``, ``token``..., ``citations``, ``done``; or ``error`` and the end of the stream."""
    async for item in job.stream():
        if isinstance(item, JobFailure):
            yield sse(error_body(item.status, item.message, item.param, item.code), event="error")
            return
        yield sse(event_payload(item), event=item.type)


@router.post(
    "/v1/answer",
    response_model=AnswerResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the answer, or its events"}
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
    options = answer_options(
        body.compression,
        settings,
        max_new_tokens=body.max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        citations=body.citations,
    )
    log["stream"] = body.stream
    job = submit_job(services, question, documents, options, namespace, log)
    if body.stream:
        return JobStreamingResponse(job, answer_events(job), log)
    try:
        meta, done = await collect_answer(job, request)
    finally:
        record_job(job, log)
    payload = event_payload(done)
    return AnswerResponse(meta=event_payload(meta), **payload)
