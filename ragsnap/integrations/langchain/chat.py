"""``ChatRagSnap``: ragsnap as a LangChain chat model, in-process or against a ragsnap server.

Documents come with the call (``chat.invoke(question, documents=docs)``), from a bound
``retriever`` (searched with a standalone question: the question after the previous user
turns, or what ``standalone_question`` returns), or inside the messages, as the LCEL
pattern ``{"context": retriever | format_docs, "question": RunnablePassthrough()} |
prompt | chat`` puts them there; :mod:`ragsnap.prompt.chat` says exactly how message
text becomes the question, instructions, history and documents. System instructions and
earlier turns reach the prompt; ``stop`` cuts the answer. Tokens stream as
``AIMessageChunk``s; the last chunk carries ``usage_metadata`` and, in
``response_metadata``, the citations, the verdict (``grounded``, ``grounded_score``,
``model_answer``; issue 43), cache status, prompt and kept tokens and every engine
statistic. With ``unsupported="abstain"``, ``invoke`` answers the abstention text when
the answer is not grounded (streamed chunks stay the model's; the last one says so). Tools and structured output are refused when bound. Needs the
``langchain`` extra (langchain-core, httpx).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ragsnap.engine.events import event_payload
from ragsnap.errors import InputError, RagSnapError
from ragsnap.integrations.langchain.retriever import from_langchain_documents
from ragsnap.prompt.assembly import DocumentOrder
from ragsnap.prompt.chat import ChatMessageText, ParsedChat, parse_messages
from ragsnap.prompt.documents import Document

Event = tuple[str, dict[str, Any]]  # ("meta" | "token" | "citations" | "done", payload)
# per-call keyword arguments ChatRagSnap understands; anything else is refused by name
CALL_KWARGS = frozenset({"documents", "model"})
NOT_SUPPORTED = (
    "ChatRagSnap answers questions from documents with citations; it does not support {what}"
)


def _stream_error(body: dict[str, Any]) -> RagSnapError:
    kind = body.get("error", {}).get("type")
    return _service_error(422 if kind == "invalid_request_error" else 500, body)


def _service_error(status: int, body: Any) -> RagSnapError:
    error = body.get("error", {}) if isinstance(body, dict) else {}
    message = f"ragsnap server answered {status}: {error.get('message', 'request failed')}"
    cls = InputError if 400 <= status < 500 else RagSnapError
    return cls(message, field=error.get("param"))


def message_text(message: BaseMessage, where: str) -> ChatMessageText:
    """A LangChain message as role and text; tool traffic and non-text parts are refused."""
    if isinstance(message, AIMessage) and (message.tool_calls or message.invalid_tool_calls):
        raise InputError(f"{where}: " + NOT_SUPPORTED.format(what="tool calls"), field=where)
    if isinstance(message.content, list) and any(
        isinstance(part, dict) and part.get("type") not in (None, "text")
        for part in message.content
    ):
        raise InputError(f"{where}: only text content is supported", field=where)
    if isinstance(message, SystemMessage):
        return ChatMessageText("system", message.text)
    if isinstance(message, HumanMessage):
        return ChatMessageText("user", message.text)
    if isinstance(message, AIMessage):
        return ChatMessageText("assistant", message.text)
    if isinstance(message, ChatMessage) and message.role in ("system", "user", "assistant"):
        return ChatMessageText(message.role, message.text)  # type: ignore[arg-type]
    raise InputError(
        f"{where}: {message.type} messages are not supported (system, human and ai are)",
        field=where,
    )


class ChatRagSnap(BaseChatModel):
    """ragsnap as a LangChain chat model.

    Give ``engine`` (a loaded :class:`ragsnap.engine.engine.RagSnapEngine`, used under a lock) or
    ``base_url`` (a running ``ragsnap serve``, with ``api_key`` when it wants one).
    ``compression`` takes the API's fields (``press``, ``budget`` | ``ratio``, ``window``...).
    Without either, ``$RAGSNAP_BASE_URL`` (and ``$RAGSNAP_API_KEY``) are used.
    ``max_tokens`` is an alias of ``max_new_tokens``; ``model`` names the model for tracing
    (default: the engine's model id, or ``ragsnap`` for a server).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: Any = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    retriever: BaseRetriever | None = None
    standalone_question: Runnable[Any, Any] | Callable[[list[BaseMessage]], str] | None = None
    """Turns the conversation into the retriever's query (e.g. an LLM chain); default:
    the question after the previous user turns."""
    compression: dict[str, Any] = Field(default_factory=dict)
    document_order: DocumentOrder | None = None
    """``relevance``: the documents by relevance to the question, the most relevant last;
    ``given``: as retrieved (one document prefix for every question); ``stable``: by
    relevance the first time a document set is seen, then as that first time; None: the
    engine's or the server's default."""
    model_name: str | None = Field(default=None, alias="model")
    max_new_tokens: int | None = Field(default=None, ge=1, alias="max_tokens")
    """None: the engine's or the server's default."""
    temperature: float = Field(default=0.0, ge=0)
    stop: list[str] | None = None
    namespace: str = "default"
    timeout: float = 300.0
    max_retries: int = Field(default=2, ge=0)  # connection retries against a server
    streaming: bool = False  # accepted for compatibility: invoke and stream answer alike
    kept_tokens: bool = False
    """Also return each document's kept-token map (``response_metadata["kept_token_map"]``)."""
    unsupported: Literal["flag", "abstain"] | None = None
    """An answer its quotes do not back (issue 43): ``flag`` it, or ``abstain``;
    None: the engine's or the server's default."""

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _from_env(cls, data: Any) -> Any:
        """``RAGSNAP_BASE_URL`` / ``RAGSNAP_API_KEY`` when neither engine nor base_url is given."""
        if isinstance(data, dict) and data.get("engine") is None and not data.get("base_url"):
            if os.environ.get("RAGSNAP_BASE_URL"):
                data = {**data, "base_url": os.environ["RAGSNAP_BASE_URL"]}
        if isinstance(data, dict) and data.get("api_key") is None:
            if os.environ.get("RAGSNAP_API_KEY"):
                data = {**data, "api_key": os.environ["RAGSNAP_API_KEY"]}
        return data

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
    def resolved_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.engine is not None:
            return str(self.engine.loaded.model_id)
        return "ragsnap"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.resolved_model_name,
            "base_url": self.base_url,
            "compression": self.compression,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ragsnap",
            ls_model_name=str(kwargs.get("model") or self.resolved_model_name),
            ls_model_type="chat",
            ls_temperature=self.temperature,
            ls_max_tokens=self.max_new_tokens,
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # -- unsupported features, refused when bound -------------------------------------

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
        raise NotImplementedError(NOT_SUPPORTED.format(what="tool calling (bind_tools)"))

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Runnable[Any, Any]:
        raise NotImplementedError(NOT_SUPPORTED.format(what="structured output"))

    # -- inputs ----------------------------------------------------------------------

    def _parse(self, messages: Sequence[BaseMessage], kwargs: dict[str, Any]) -> ParsedChat:
        unknown = sorted(set(kwargs) - CALL_KWARGS)
        if unknown:
            raise InputError(
                f"unsupported argument(s) {', '.join(unknown)}: "
                + NOT_SUPPORTED.format(what="them"),
                field=unknown[0],
            )
        texts = [message_text(m, f"messages[{i}]") for i, m in enumerate(messages)]
        return parse_messages(texts)

    def _query(self, messages: list[BaseMessage], parsed: ParsedChat) -> str:
        rewrite = self.standalone_question
        if rewrite is None:
            return parsed.retrieval_query()
        out = rewrite.invoke(messages) if isinstance(rewrite, Runnable) else rewrite(messages)
        return str(getattr(out, "content", out))

    def _inputs(
        self,
        messages: list[BaseMessage],
        kwargs: dict[str, Any],
        run_manager: CallbackManagerForLLMRun | None,
    ) -> tuple[ParsedChat, list[Document]]:
        parsed = self._parse(messages, kwargs)
        given = kwargs.get("documents")
        if given is None and self.retriever is not None and not parsed.context_labelled:
            given = self.retriever.invoke(self._query(messages, parsed))
        ours = from_langchain_documents(given) if given is not None else None
        return parsed, parsed.documents(ours)

    async def _ainputs(
        self,
        messages: list[BaseMessage],
        kwargs: dict[str, Any],
        run_manager: AsyncCallbackManagerForLLMRun | None,
    ) -> tuple[ParsedChat, list[Document]]:
        parsed = self._parse(messages, kwargs)
        given = kwargs.get("documents")
        if given is None and self.retriever is not None and not parsed.context_labelled:
            rewrite = self.standalone_question
            if isinstance(rewrite, Runnable):
                out = await rewrite.ainvoke(messages)
                query = str(getattr(out, "content", out))
            else:
                query = self._query(messages, parsed)
            given = await self.retriever.ainvoke(query)
        ours = from_langchain_documents(given) if given is not None else None
        return parsed, parsed.documents(ours)

    def _stop(self, stop: list[str] | None) -> tuple[str, ...]:
        return tuple(stop if stop is not None else self.stop or ())

    # -- event sources ---------------------------------------------------------------

    def _options(self, parsed: ParsedChat, stop: tuple[str, ...]) -> Any:
        """The engine's options for what this model sets (the rest from the engine's config,
        resolved as every entrance resolves it)."""
        from pydantic import ValidationError

        from ragsnap.engine.press_settings import PressOverrides

        try:  # the API's compression fields, with their bounds
            compression = PressOverrides.model_validate(self.compression)
        except ValidationError as exc:
            first = exc.errors()[0]
            name = ".".join(["compression", *map(str, first["loc"])])
            raise InputError(f"{name}: {first['msg']}", field=name) from None
        return self.engine.default_options(
            compression=compression,
            generation={
                "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature,
                "stop": stop,
            },
            citations={"unsupported": self.unsupported},
            document_order=self.document_order,
            chat=parsed.chat,
            kept_tokens=self.kept_tokens,
        )

    def _local_events(
        self,
        parsed: ParsedChat,
        documents: list[Document],
        stop: tuple[str, ...],
        halt: threading.Event | None = None,
    ) -> Generator[Event, None, None]:
        should_stop = halt.is_set if halt is not None else None
        with self._lock:
            events = self.engine.stream(  # stop strings are the engine's (ragsnap.engine.stopping)
                parsed.question,
                documents,
                self._options(parsed, stop),
                should_stop=should_stop,
                namespace=self.namespace,
            )
            try:
                for event in events:
                    yield event.type, event_payload(event)
            finally:
                events.close()  # an abandoned stream stops generating

    def _request(
        self, parsed: ParsedChat, documents: list[Document], stop: tuple[str, ...]
    ) -> dict[str, Any]:
        headers: dict[str, str] = {}  # connect_sse adds Accept: text/event-stream
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        body = {
            "question": parsed.question,
            "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in documents],
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "compression": self.compression or None,
            "document_order": self.document_order,
            "kept_tokens": self.kept_tokens,
            "instructions": parsed.instructions or None,
            "history": [{"role": t.role, "content": t.text} for t in parsed.history] or None,
            "stop": list(stop) or None,
            "unsupported": self.unsupported,
            "stream": True,
        }
        url = f"{str(self.base_url).rstrip('/')}/v1/answer"
        return {"method": "POST", "url": url, "json": body, "headers": headers}

    def _remote_events(
        self, parsed: ParsedChat, documents: list[Document], stop: tuple[str, ...]
    ) -> Iterator[Event]:
        import httpx
        from httpx_sse import connect_sse

        transport = httpx.HTTPTransport(retries=self.max_retries)
        with httpx.Client(timeout=self.timeout, transport=transport) as client:
            with connect_sse(client, **self._request(parsed, documents, stop)) as source:
                if source.response.status_code != 200:
                    source.response.read()
                    raise _service_error(source.response.status_code, source.response.json())
                for sse in source.iter_sse():
                    if sse.event == "error":
                        raise _stream_error(sse.json())
                    yield sse.event, sse.json()

    async def _aremote_events(
        self, parsed: ParsedChat, documents: list[Document], stop: tuple[str, ...]
    ) -> AsyncIterator[Event]:
        import httpx
        from httpx_sse import aconnect_sse

        transport = httpx.AsyncHTTPTransport(retries=self.max_retries)
        async with httpx.AsyncClient(timeout=self.timeout, transport=transport) as client:
            async with aconnect_sse(client, **self._request(parsed, documents, stop)) as source:
                if source.response.status_code != 200:
                    await source.response.aread()
                    raise _service_error(source.response.status_code, source.response.json())
                async for sse in source.aiter_sse():
                    if sse.event == "error":
                        raise _stream_error(sse.json())
                    yield sse.event, sse.json()

    # -- chunks ----------------------------------------------------------------------

    def _final_chunk(self, meta: dict[str, Any], done: dict[str, Any]) -> ChatGenerationChunk:
        stats = done["stats"]
        prompt, new = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
        stopped = stats.get("finish_reason", "stop") == "stop"
        metadata = {
            "model_name": stats.get("model"),
            "finish_reason": "stop" if stopped else "length",
            "citations": done["citations"],
            "cache": stats.get("cache"),
            "prompt_tokens": prompt,
            "kept_tokens": stats.get("kept_tokens"),
            "documents": meta.get("documents", []),
            "ragsnap": stats,
            # the verdict (issue 43); answer: what an abstention replaced the tokens with
            "grounded": done.get("grounded"),
            "grounded_score": done.get("grounded_score"),
            "unsupported_sentences": done.get("unsupported_sentences", []),
            "not_in_documents": done.get("not_in_documents", []),
            "answer_not_in_documents": done.get("answer_not_in_documents", []),
            "model_answer": done.get("model_answer"),
            "answer": done.get("answer"),
            "answer_with_markers": done.get("answer_with_markers"),
            "kept_token_map": done.get("kept_tokens"),  # with kept_tokens=True
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
        parsed, documents = self._inputs(messages, kwargs, run_manager)
        stops = self._stop(stop)
        source = (
            self._local_events(parsed, documents, stops)
            if self.engine is not None
            else self._remote_events(parsed, documents, stops)
        )
        meta: dict[str, Any] = {}
        for name, data in source:
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
        parsed, documents = await self._ainputs(messages, kwargs, run_manager)
        meta: dict[str, Any] = {}
        async for name, data in self._aevents(parsed, documents, self._stop(stop)):
            if name == "token":
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=data["text"]))
                if run_manager:
                    await run_manager.on_llm_new_token(data["text"], chunk=chunk)
                yield chunk
            elif name == "meta":
                meta = data
            elif name == "done":
                yield self._final_chunk(meta, data)

    async def _aevents(
        self, parsed: ParsedChat, documents: list[Document], stop: tuple[str, ...]
    ) -> AsyncIterator[Event]:
        if self.engine is None:
            async for event in self._aremote_events(parsed, documents, stop):
                yield event
            return
        # the engine is synchronous: step it in a worker thread, close it if we stop early
        halt = threading.Event()
        iterator = self._local_events(parsed, documents, stop, halt)
        end = object()
        try:
            while True:
                item = await asyncio.to_thread(next, iterator, end)
                if item is end:
                    return
                yield item  # type: ignore[misc]
        finally:
            halt.set()  # a step still running in its thread ends after this decode step
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
        return _abstained(generate_from_stream(self._stream(messages, stop, run_manager, **kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        return _abstained(result)


def _abstained(result: ChatResult) -> ChatResult:
    """``result`` with the abstention text as its content when the answer was replaced
    (``unsupported="abstain"``); the model's own stays in ``model_answer``."""
    generation = result.generations[0]
    metadata = generation.message.response_metadata
    if metadata.get("model_answer") is None:
        return result
    message = generation.message.model_copy(update={"content": metadata["answer"]})
    replaced = ChatGeneration(message=message, generation_info=generation.generation_info)
    return ChatResult(generations=[replaced], llm_output=result.llm_output)
