"""``ChatRagSnap``: ragsnap as a LangChain chat model, in-process or against a ragsnap server.

The question is the last human message; the documents come with the call
(``chat.invoke(question, documents=docs)``) or from a bound ``retriever``. Tokens stream
as ``AIMessageChunk``s; the last chunk carries ``usage_metadata`` and, in
``response_metadata``, the citations, cache status, prompt and kept tokens and every
engine statistic. Needs the ``langchain`` extra (langchain-core, httpx).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ragsnap.documents import Document
from ragsnap.errors import InputError, RagSnapError
from ragsnap.events import AnswerEvent, DoneEvent, MetaEvent, TokenEvent
from ragsnap.integrations.langchain.retriever import from_langchain_documents

Event = tuple[str, dict[str, Any]]  # ("meta" | "token" | "citations" | "done", payload)


def _payload(event: AnswerEvent) -> dict[str, Any]:
    if isinstance(event, MetaEvent):
        return {k: v for k, v in asdict(event).items() if k != "type"}
    if isinstance(event, TokenEvent):
        return {"text": event.text}
    if isinstance(event, DoneEvent):
        citations = [c.to_dict() for c in event.citations]
        return {"answer": event.answer, "citations": citations, "stats": event.stats}
    return {"citations": [c.to_dict() for c in event.citations]}


class _SSEDecoder:
    """Feeds Server-Sent Events lines; returns ``(event, data)`` at each blank line."""

    def __init__(self) -> None:
        self.name, self.data = "message", []  # type: tuple[str, list[str]]

    def feed(self, line: str) -> Event | None:
        if line.startswith("event:"):
            self.name = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].strip())
        elif not line and self.data:
            event = (self.name, json.loads("\n".join(self.data)))
            self.name, self.data = "message", []
            return event
        return None


def _stream_error(body: dict[str, Any]) -> RagSnapError:
    kind = body.get("error", {}).get("type")
    return _service_error(422 if kind == "invalid_request_error" else 500, body)


def _service_error(status: int, body: Any) -> RagSnapError:
    error = body.get("error", {}) if isinstance(body, dict) else {}
    message = f"ragsnap server answered {status}: {error.get('message', 'request failed')}"
    cls = InputError if 400 <= status < 500 else RagSnapError
    return cls(message, field=error.get("param"))


class ChatRagSnap(BaseChatModel):
    """ragsnap as a LangChain chat model.

    Give ``engine`` (a loaded :class:`ragsnap.engine.RagSnapEngine`, used under a lock) or
    ``base_url`` (a running ``ragsnap serve``, with ``api_key`` when it wants one).
    ``compression`` takes the API's fields (``press``, ``budget`` | ``ratio``, ``window``...).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    retriever: BaseRetriever | None = None
    compression: dict[str, Any] = Field(default_factory=dict)
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    namespace: str = "default"
    timeout: float = 300.0

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="after")
    def _one_backend(self) -> ChatRagSnap:
        if (self.engine is None) == (self.base_url is None):
            raise ValueError(
                "give exactly one of engine (in-process) or base_url (a ragsnap server)"
            )
        return self

    @property
    def _llm_type(self) -> str:
        return "ragsnap"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        model = self.engine.loaded.model_id if self.engine is not None else self.base_url
        return {
            "model": model,
            "compression": self.compression,
            "max_new_tokens": self.max_new_tokens,
        }

    # -- inputs ----------------------------------------------------------------------

    def _question(self, messages: Sequence[BaseMessage]) -> str:
        for message in reversed(messages):
            if isinstance(message, HumanMessage):
                if message.text.strip():
                    return message.text
                break
        raise InputError("the last human message is missing or empty", field="messages")

    def _documents(self, question: str, documents: Any) -> list[Document]:
        if documents is None and self.retriever is not None:
            documents = self.retriever.invoke(question)
        if not documents:
            raise InputError(
                "no documents: pass documents=[...] or bind a retriever", field="documents"
            )
        return from_langchain_documents(documents)

    async def _adocuments(self, question: str, documents: Any) -> list[Document]:
        if documents is None and self.retriever is not None:
            documents = await self.retriever.ainvoke(question)
        return self._documents(question, documents)

    # -- event sources ---------------------------------------------------------------

    def _options(self) -> Any:
        from ragsnap.compression import DEFAULT_PRESS, make_press
        from ragsnap.engine import AnswerOptions
        from ragsnap.generation import GenerationConfig

        options = dict(self.compression)
        press = make_press(options.pop("press", None) or DEFAULT_PRESS, **options)
        generation = GenerationConfig(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature
        )
        return AnswerOptions(press=press, generation=generation)

    def _local_events(
        self, question: str, documents: list[Document], stop: threading.Event | None = None
    ) -> Generator[Event, None, None]:
        should_stop = stop.is_set if stop is not None else None
        with self._lock:
            events = self.engine.stream(
                question,
                documents,
                self._options(),
                should_stop=should_stop,
                namespace=self.namespace,
            )
            try:
                for event in events:
                    yield event.type, _payload(event)
            finally:
                events.close()  # an abandoned stream stops generating

    def _request(self, question: str, documents: list[Document]) -> dict[str, Any]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        body = {
            "question": question,
            "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in documents],
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "compression": self.compression or None,
            "stream": True,
        }
        url = f"{str(self.base_url).rstrip('/')}/v1/answer"
        return {"method": "POST", "url": url, "json": body, "headers": headers}

    def _remote_events(self, question: str, documents: list[Document]) -> Iterator[Event]:
        import httpx

        decoder = _SSEDecoder()
        with httpx.Client(timeout=self.timeout) as client:
            with client.stream(**self._request(question, documents)) as response:
                if response.status_code != 200:
                    response.read()
                    raise _service_error(response.status_code, response.json())
                for line in response.iter_lines():
                    event = decoder.feed(line)
                    if event and event[0] == "error":
                        raise _stream_error(event[1])
                    if event:
                        yield event

    async def _aremote_events(
        self, question: str, documents: list[Document]
    ) -> AsyncIterator[Event]:
        import httpx

        decoder = _SSEDecoder()
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            async with client.stream(**self._request(question, documents)) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _service_error(response.status_code, response.json())
                async for line in response.aiter_lines():
                    event = decoder.feed(line)
                    if event and event[0] == "error":
                        raise _stream_error(event[1])
                    if event:
                        yield event

    # -- chunks ----------------------------------------------------------------------

    def _final_chunk(self, meta: dict[str, Any], done: dict[str, Any]) -> ChatGenerationChunk:
        stats = done["stats"]
        prompt, new = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
        metadata = {
            "model_name": stats.get("model"),
            "finish_reason": "length" if new >= self.max_new_tokens else "stop",
            "citations": done["citations"],
            "cache": stats.get("cache"),
            "prompt_tokens": prompt,
            "kept_tokens": stats.get("kept_tokens"),
            "documents": meta.get("documents", []),
            "ragsnap": stats,
        }
        usage = UsageMetadata(input_tokens=prompt, output_tokens=new, total_tokens=prompt + new)
        message = AIMessageChunk(
            content="", response_metadata=metadata, usage_metadata=usage, chunk_position="last"
        )
        return ChatGenerationChunk(message=message)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        question = self._question(messages)
        documents = self._documents(question, kwargs.get("documents"))
        source = self._local_events if self.engine is not None else self._remote_events
        meta: dict[str, Any] = {}
        for name, data in source(question, documents):
            if name == "token":
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=data["text"]))
                if run_manager:
                    run_manager.on_llm_new_token(data["text"], chunk=chunk)
                yield chunk
            elif name == "meta":
                meta = data
            elif name == "done":
                yield self._final_chunk(meta, data)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        question = self._question(messages)
        documents = await self._adocuments(question, kwargs.get("documents"))
        meta: dict[str, Any] = {}
        async for name, data in self._aevents(question, documents):
            if name == "token":
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=data["text"]))
                if run_manager:
                    await run_manager.on_llm_new_token(data["text"], chunk=chunk)
                yield chunk
            elif name == "meta":
                meta = data
            elif name == "done":
                yield self._final_chunk(meta, data)

    async def _aevents(self, question: str, documents: list[Document]) -> AsyncIterator[Event]:
        if self.engine is None:
            async for event in self._aremote_events(question, documents):
                yield event
            return
        # the engine is synchronous: step it in a worker thread, close it if we stop early
        stop = threading.Event()
        iterator = self._local_events(question, documents, stop)
        end = object()
        try:
            while True:
                item = await asyncio.to_thread(next, iterator, end)
                if item is end:
                    return
                yield item  # type: ignore[misc]
        finally:
            stop.set()  # a step still running in its thread ends after this decode step
            try:
                iterator.close()
            except ValueError:  # that step is still running: the stop flag ends it
                pass

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
