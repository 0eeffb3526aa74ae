"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models``.

The route is thin: :mod:`ragsnap.api.openai_serving` turns the body into ragsnap's inputs (and
refuses what ragsnap cannot honour); the response, or the final stream chunk, carries
``citations``, ``documents`` (those in the prompt, in order) and ``ragsnap`` (the
engine's statistics). Usage is sent once: in the
response, or in the usage-only chunk of a stream that asked for it (``include_usage``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import ServerSentEvent

from ragsnap.api.answering import (
    answer_options,
    check_tokens,
    collect_answer,
    record_job,
    submit_job,
)
from ragsnap.api.deps import NamespaceDep, RequestLogDep, ServicesDep, SettingsDep
from ragsnap.api.errors import ApiError, error_body
from ragsnap.api.openai_serving import (
    chat_documents,
    citation_annotations,
    citation_logprobs,
    conversation,
    parse_chat,
    refuse_unsupported,
    sources_text,
    usage,
)
from ragsnap.api.openapi import CHUNK_EVENTS, errors
from ragsnap.api.schemas import ChatCompletionRequest
from ragsnap.api.services import Services
from ragsnap.api.settings import Settings
from ragsnap.api.streaming import JobStreamingResponse, sse
from ragsnap.api.worker import AnswerJob, JobFailure
from ragsnap.engine.events import CitationsEvent, DoneEvent, MetaEvent, TokenEvent, event_payload

router = APIRouter(tags=["openai"])


def served_names(services: Services, settings: Settings) -> list[str]:
    return [services.model_id, settings.served_model_name]


@router.get("/v1/models", responses=errors(400, 401, 429, 503))
async def list_models(services: ServicesDep, settings: SettingsDep) -> dict[str, Any]:
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "ragsnap"}
            for name in served_names(services, settings)
        ],
    }


async def completion_chunks(
    job: AnswerJob, base: dict[str, Any], include_usage: bool, sources: bool
) -> AsyncIterator[ServerSentEvent]:
    """Role chunk, one content chunk per token event, a final chunk with ``finish_reason``,
    ``citations`` (also as ``annotations`` and in ``logprobs``) and ``ragsnap`` stats; the
    usage-only chunk when asked for; then ``[DONE]``. A failure is an ``error`` chunk."""

    def chunk(
        delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any
    ) -> ServerSentEvent:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    yield chunk({"role": "assistant", "content": ""})
    documents: list[dict[str, str]] = []
    async for item in job.stream():
        if isinstance(item, JobFailure):
            yield sse(
                error_body(
                    item.status if item.status != 422 else 400, item.message, item.param, item.code
                )
            )
            break
        if isinstance(item, MetaEvent):
            documents = item.documents
        elif isinstance(item, TokenEvent):
            yield chunk({"content": item.text})
        elif isinstance(item, DoneEvent):
            stats = item.stats
            citations = event_payload(CitationsEvent(item.citations))["citations"]
            footer = sources_text(item.citations) if sources else ""
            if footer:
                yield chunk({"content": footer})
            delta = {"annotations": citation_annotations(item.answer, item.citations)}
            finish = stats.finish_reason
            logprobs = citation_logprobs(citations)
            ragsnap = {**stats.to_dict(), **item.verdict()}  # the verdict (issue 43)
            if item.model_answer is not None:  # abstained: the answer that replaces it
                ragsnap["answer"] = item.answer
            extra = {"citations": citations, "documents": documents, "ragsnap": ragsnap}
            yield chunk(delta, finish, logprobs, **extra)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(stats)})
    yield sse("[DONE]")


@router.post(
    "/v1/chat/completions",
    responses={
        200: {
            "content": CHUNK_EVENTS,
            "description": "a chat.completion, or its chunks (stream: true)",
        },
        **errors(400, 401, 404, 408, 413, 429, 503),
    },
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    services: ServicesDep,
    settings: SettingsDep,
    namespace: NamespaceDep,
    log: RequestLogDep,
) -> Any:
    if body.model not in served_names(services, settings):
        raise ApiError(
            404,
            f"model {body.model!r} is not served here (see /v1/models)",
            param="model",
            code="model_not_found",
        )
    refuse_unsupported(body)
    parsed = parse_chat(body, settings)
    documents = chat_documents(body, parsed, services, settings)
    check_tokens(parsed.question, documents, services, settings, param="messages")
    chat = conversation(parsed, settings)  # after: the system text may have become the context
    tokens_param = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    options = answer_options(
        body.compression,
        settings,
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        tokens_param=tokens_param,
        stop=body.stop,
        chat=chat,
        document_order=body.document_order,
        unsupported=body.unsupported,
    )
    log["stream"] = body.stream
    job = await submit_job(services, parsed.question, documents, options, namespace, log)
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = completion_chunks(job, base, include_usage, body.sources)
        return JobStreamingResponse(job, chunks, log)
    try:
        meta, done = await collect_answer(job, request)
    finally:
        record_job(job, log)
    citations = [c.to_dict() for c in done.citations]
    content = done.answer + (sources_text(done.citations) if body.sources else "")
    message = {
        "role": "assistant",
        "content": content,
        # an abstention's text quotes nothing: no offsets into it
        "annotations": []
        if done.model_answer is not None
        else citation_annotations(done.answer, done.citations),
    }
    return {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": citation_logprobs(citations),
                "finish_reason": done.stats.finish_reason,
            }
        ],
        "usage": usage(done.stats),
        "citations": citations,
        "documents": meta.documents,
        "ragsnap": {**done.stats.to_dict(), **done.verdict()},
    }
