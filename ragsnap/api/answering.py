"""What both answer routes share: limits, documents, options, queueing, waiting for the result."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from ragsnap.api.errors import ApiError
from ragsnap.api.schemas import CitationsIn, CompressionIn, DocumentIn, RetrievalFields
from ragsnap.api.services import Services
from ragsnap.api.settings import Settings
from ragsnap.api.worker import AnswerJob, JobFailure, QueueFullError, WorkerStoppedError
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import DoneEvent, MetaEvent
from ragsnap.engine.request_options import answer_options as request_options
from ragsnap.errors import ConfigError
from ragsnap.prompt.assembly import ChatContext, DocumentOrder, Turn
from ragsnap.prompt.chat import unique_ids
from ragsnap.prompt.documents import Document

# GenerationConfig's fields: a ConfigError naming one is about a top-level request field
GENERATION_FIELDS = frozenset({"max_new_tokens", "temperature", "top_p", "seed", "stop"})


def check_question(question: str, settings: Settings, param: str = "question") -> str:
    if not question.strip():
        raise ApiError(422, f"{param}: must not be empty", param=param, code="invalid_value")
    if len(question) > settings.max_question_chars:
        raise ApiError(
            413,
            f"{param}: longer than {settings.max_question_chars} characters",
            param=param,
            code="question_too_long",
        )
    return question


def inline_documents(documents: Sequence[DocumentIn], settings: Settings) -> list[Document]:
    """The body's documents within the server's limits (413 over one). An id given twice:
    the same document again counts once; another document with it is cited as ``id~2``
    (``~3``...), as the chat route names repeated ids (:func:`ragsnap.prompt.chat.unique_ids`)."""
    if len(documents) > settings.max_documents:
        raise ApiError(
            413,
            f"documents: {len(documents)} given, at most {settings.max_documents} allowed",
            param="documents",
            code="too_many_documents",
        )
    out: list[Document] = []
    seen: set[Document] = set()
    total = 0
    for i, doc in enumerate(documents):
        size = len(doc.text.encode("utf-8")) + len(doc.title.encode("utf-8"))
        if size > settings.max_document_bytes:
            raise ApiError(
                413,
                f"documents[{i}]: {size} bytes, at most {settings.max_document_bytes} allowed",
                param=f"documents[{i}].text",
                code="document_too_large",
            )
        given = Document(
            id=str(doc.id) if doc.id is not None else str(i + 1),
            text=doc.text,
            title=doc.title,
            format=doc.format,
        )
        if given not in seen:  # the same document twice is one document
            seen.add(given)
            total += size
            out.append(given)
    if total > settings.max_total_bytes:
        raise ApiError(
            413,
            f"documents: {total} bytes in all, at most {settings.max_total_bytes} allowed",
            param="documents",
            code="documents_too_large",
        )
    return unique_ids(out)


def check_tokens(
    question: str,
    documents: Sequence[Document],
    services: Services,
    settings: Settings,
    param: str = "question",
) -> None:
    """413 when the question, a document or the whole prompt is over its token limit
    (counted by the served model's tokenizer, control strings split as the prompt does)."""
    from ragsnap.prompt.assembly import encode_user_text

    tokenizer = services.tokenizer
    asked = len(encode_user_text(tokenizer, question))
    if asked > settings.max_question_tokens:
        raise ApiError(
            413,
            f"{param}: {asked} tokens, at most {settings.max_question_tokens} allowed",
            param=param,
            code="question_too_many_tokens",
        )
    total = asked
    for i, doc in enumerate(documents):
        count = len(encode_user_text(tokenizer, f"{doc.title}\n{doc.text}"))
        if count > settings.max_document_tokens:
            raise ApiError(
                413,
                f"documents[{i}]: {count} tokens, at most {settings.max_document_tokens} allowed",
                param=f"documents[{i}].text",
                code="document_too_many_tokens",
            )
        total += count
    if total > settings.max_prompt_tokens:
        raise ApiError(
            413,
            f"documents and question: {total} tokens, at most {settings.max_prompt_tokens} allowed",
            param="documents",
            code="prompt_too_many_tokens",
        )


def corpus_top_k(services: Services, settings: Settings, top_k: int | None) -> int:
    """How many passages to take from the server's corpus; 422 without a corpus or past
    the server's limit."""
    if services.index is None:
        raise ApiError(
            422,
            "query: this server has no corpus (set RAGSNAP_CORPUS_DIR)",
            param="query",
            code="no_corpus",
        )
    return check_top_k(top_k if top_k is not None else settings.default_top_k, settings)


def check_top_k(top_k: int, settings: Settings) -> int:
    """``top_k``, or a 422 past the server's limit (checked whenever a request gives it,
    as the schema states it)."""
    if top_k > settings.max_top_k:
        raise ApiError(
            422, f"top_k: at most {settings.max_top_k}", param="top_k", code="invalid_value"
        )
    return top_k


def resolve_documents(
    fields: RetrievalFields, services: Services, settings: Settings
) -> list[Document]:
    """The request's documents: given inline (within the limits) or found by ``query``
    (maybe none)."""
    if fields.top_k is not None:
        check_top_k(fields.top_k, settings)
    if fields.documents is not None and fields.query is not None:
        raise ApiError(
            422, "give documents or query, not both", param="query", code="invalid_value"
        )
    if fields.documents is not None:
        if not fields.documents:
            raise ApiError(
                422, "documents: give at least one", param="documents", code="invalid_value"
            )
        return inline_documents(fields.documents, settings)
    if fields.query is None:
        raise ApiError(
            422,
            "give documents, or a query over the server's corpus",
            param="documents",
            code="missing_field",
        )
    top_k = corpus_top_k(services, settings, fields.top_k)
    assert services.index is not None
    # no passage found: an answer over none (not grounded), as a chat's own search gets
    return services.index.retrieve(fields.query, top_k)


def chat_context(
    instructions: str | None,
    history: Sequence[Turn],
    settings: Settings,
    param: str = "history",
) -> ChatContext | None:
    """A chat's instructions and earlier turns, within the question's size limit times
    the turns allowed (413 naming ``param`` over it)."""
    if not (instructions or "").strip() and not history:
        return None
    size = len(instructions or "") + sum(len(t.text) for t in history)
    limit = settings.max_question_chars * 16
    if size > limit:
        raise ApiError(
            413,
            f"{param}: {size} characters of instructions and earlier turns, at most {limit}",
            param=param,
            code="history_too_long",
        )
    return ChatContext(instructions=instructions or "", history=tuple(history))


def answer_options(
    compression: CompressionIn | None,
    settings: Settings,
    *,
    max_new_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    tokens_param: str = "max_new_tokens",
    stop: str | Sequence[str] | None = None,
    chat: ChatContext | None = None,
    citations: CitationsIn | None = None,
    kept_tokens: bool = False,
    document_order: DocumentOrder | None = None,
    unsupported: str | None = None,
) -> AnswerOptions:
    """The request's options (:func:`ragsnap.engine.request_options.answer_options` over the
    server's settings), its answer length within the server's limit; a bad value is a 422
    naming its field (``compression.<field>`` for a press option)."""
    default = min(settings.default_max_new_tokens, settings.max_new_tokens_limit)
    tokens = max_new_tokens if max_new_tokens is not None else default
    if tokens > settings.max_new_tokens_limit:
        raise ApiError(
            422,
            f"{tokens_param}: at most {settings.max_new_tokens_limit}",
            param=tokens_param,
            code="invalid_value",
        )
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    cite = citations or CitationsIn()
    try:
        return request_options(
            settings,
            compression,
            generation={
                "max_new_tokens": tokens,
                "temperature": temperature or 0.0,
                "top_p": top_p if top_p is not None else 1.0,
                "seed": seed,
                "stop": stops,
            },
            citations={**cite.model_dump(), "unsupported": unsupported},
            chat=chat,
            kept_tokens=kept_tokens,
            document_order=document_order,
        )
    except ConfigError as exc:
        param = _param_of(exc.field)
        raise ApiError(422, f"{param}: {exc.message}", param=param, code="invalid_value") from None


def _param_of(field: str | None) -> str:
    """The request field a :class:`ConfigError` names: generation fields are top-level,
    the others are the ``compression`` object's."""
    if field in GENERATION_FIELDS:
        return field
    return f"compression.{field}" if field else "compression"


async def submit_job(
    services: Services,
    question: str,
    documents: list[Document],
    options: AnswerOptions,
    namespace: str,
    log: dict[str, Any],
) -> AnswerJob:
    """Queue an answer; 429 with ``Retry-After`` when the queue is full, 503 when stopping."""
    job = AnswerJob(
        request_id=str(log.get("request_id", uuid.uuid4().hex[:16])),
        question=question,
        documents=documents,
        options=options,
        namespace=namespace,
    )
    log["documents"] = len(documents)
    try:
        await services.worker.admit(job)
    except QueueFullError as exc:
        raise ApiError(
            429,
            "the server is busy: too many requests are waiting; retry later",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except WorkerStoppedError:
        raise ApiError(
            503,
            "the server is not accepting answers",
            code="not_ready",
            headers={"Retry-After": "5"},
        ) from None
    return job


def record_job(job: AnswerJob, log: dict[str, Any], client_gone: bool = False) -> None:
    """Put the job's outcome and timings (never its text) into the request's log line."""
    outcome = job.outcome
    # a client that left a non-streaming answer: the worker may not have seen it yet
    if client_gone or (job.cancelled.is_set() and outcome not in {"ok", "error"}):
        outcome = "cancelled"
    log["outcome"] = outcome
    if job.queue_s is not None:
        log["queue_s"] = round(job.queue_s, 4)
    if (stats := job.stats) is not None:
        log.update(
            cache=stats.cache,
            prompt_tokens=stats.prompt_tokens,
            kept_tokens=stats.kept_tokens,
            new_tokens=stats.new_tokens,
            prefill_s=stats.prefill_s,
            ttft_s=stats.ttft_s,
            total_s=stats.total_s,
        )


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_answer(job: AnswerJob, request: Request) -> tuple[MetaEvent, DoneEvent]:
    """Wait for the whole answer; cancel the job when the client goes away first."""
    meta: MetaEvent | None = None
    done: DoneEvent | None = None
    failure: JobFailure | None = None

    async def consume() -> None:
        nonlocal meta, done, failure
        async for item in job.stream():
            if isinstance(item, JobFailure):
                failure = item
            elif isinstance(item, MetaEvent):
                meta = item
            elif isinstance(item, DoneEvent):
                done = item

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            job.cancel()
            consumer.cancel()
    if failure is not None:
        raise ApiError(failure.status, failure.message, param=failure.param, code=failure.code)
    if meta is None or done is None:
        job.cancel()
        raise ApiError(
            499 if job.cancelled.is_set() else 500, "the answer was cancelled", code="cancelled"
        )
    if meta.kept_tokens is None:  # sent before compression: the whole answer knows it
        meta = dataclasses.replace(meta, kept_tokens=done.stats.kept_tokens)
    return meta, done
