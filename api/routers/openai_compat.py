"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models``.

The question is the last user message; documents (or ``query``/``top_k``) and
``compression`` travel as extra body fields. The response, or the final stream chunk,
carries ``citations`` and ``ragsnap`` (the engine's statistics).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from api.answering import (
    answer_options,
    check_question,
    check_tokens,
    collect_answer,
    event_payload,
    record_job,
    resolve_documents,
    submit_job,
)
from api.deps import NamespaceDep, RequestLogDep, ServicesDep, SettingsDep
from api.errors import ApiError, error_body
from api.openapi import CHUNK_EVENTS, errors
from api.schemas import ChatCompletionRequest
from api.services import Services
from api.settings import Settings
from api.streaming import JobStreamingResponse, sse
from api.worker import AnswerJob, JobFailure
from ragsnap.events import CitationsEvent, DoneEvent, TokenEvent

router = APIRouter(tags=["openai"])


def served_names(services: Services, settings: Settings) -> list[str]:
    return [services.model_id, settings.served_model_name]


def _usage(stats: dict[str, Any]) -> dict[str, int]:
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish_reason(stats: dict[str, Any], max_new_tokens: int) -> str:
    return "length" if int(stats.get("new_tokens", 0)) >= max_new_tokens else "stop"


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
    job: AnswerJob, base: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    """Role chunk, one content chunk per token event, a final chunk with ``finish_reason``,
    ``citations`` and ``ragsnap`` stats; then ``[DONE]``. A failure is an ``error`` chunk."""

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    yield chunk({"role": "assistant", "content": ""})
    async for item in job.stream():
        if isinstance(item, JobFailure):
            yield sse(
                error_body(
                    item.status if item.status != 422 else 400, item.message, item.param, item.code
                )
            )
            break
        if isinstance(item, TokenEvent):
            yield chunk({"content": item.text})
        elif isinstance(item, DoneEvent):
            stats = item.stats
            citations = event_payload(CitationsEvent(item.citations))["citations"]
            finish = _finish_reason(stats, job.options.generation.max_new_tokens)
            usage = _usage(stats)
            yield chunk({}, finish, citations=citations, ragsnap=stats, usage=usage)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage})
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
    question = check_question(body.question(), settings, param="messages")
    documents = resolve_documents(body, services, settings)
    check_tokens(question, documents, services, settings, param="messages")
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
    )
    log["stream"] = body.stream
    job = submit_job(services, question, documents, options, namespace, log)
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return JobStreamingResponse(job, completion_chunks(job, base, include_usage), log)
    try:
        _, done = await collect_answer(job, request)
    finally:
        record_job(job, log)
    return {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.answer},
                "logprobs": None,
                "finish_reason": _finish_reason(done.stats, options.generation.max_new_tokens),
            }
        ],
        "usage": _usage(done.stats),
        "citations": [c.to_dict() for c in done.citations],
        "ragsnap": done.stats,
    }
