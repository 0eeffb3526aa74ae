"""Serving ``/v1/chat/completions``: OpenAI's body in, ragsnap's inputs out, and back.

- Fields OpenAI defines that ragsnap does not implement (tools, response_format, n > 1,
  logprobs...) are refused with a 400 naming the field, unless they hold their "off"
  value; unknown fields are refused too, so nothing is silently ignored.
- Messages become question, instructions, history and documents by the rules of
  :mod:`ragsnap.prompt.chat`. Documents come from the body (``documents``, or ``query``
  over the corpus), else from the messages' context, else, when the server has a corpus,
  from searching it with the conversation's standalone question; with none, the answer is
  over no documents (not grounded, as when a search finds nothing).
- Citations travel three ways, for three kinds of client: top-level ``citations`` (the
  ``openai`` client's ``model_extra``), ``message.annotations`` / the final
  ``delta.annotations`` (OpenAI's ``url_citation`` shape, ``url`` = ``ragsnap:doc/<id>``,
  offsets of the ``[n]`` marker), and ``choices[0].logprobs.ragsnap_citations``: the one
  choice field ``langchain-openai``'s ``ChatOpenAI`` keeps (in ``response_metadata
  ["logprobs"]``), whose ``content`` stays null. ``"sources": true`` also appends a
  ``Sources:`` list to the answer text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ragsnap.api.answering import (
    chat_context,
    check_top_k,
    inline_documents,
    resolve_documents,
)
from ragsnap.api.errors import ApiError
from ragsnap.api.schemas import ChatCompletionRequest, DocumentIn
from ragsnap.api.services import Services
from ragsnap.api.settings import Settings
from ragsnap.citations import Citation, cited_indices
from ragsnap.citations.sentences import split_sentences
from ragsnap.engine.stats import AnswerStats
from ragsnap.errors import InputError
from ragsnap.prompt.assembly import ChatContext
from ragsnap.prompt.chat import ChatMessageText, ParsedChat, parse_messages
from ragsnap.prompt.documents import Document

# OpenAI request fields ragsnap does not implement, with the values that mean "not used"
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
}
# fields that do not change an answer: accepted and not used
_INERT = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier"}
)


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400 naming the first field ragsnap cannot honour."""
    for name, value in (body.model_extra or {}).items():
        if name in _INERT:
            continue
        if name not in _OFF_VALUES:
            raise ApiError(400, f"{name}: unknown field", param=name, code="unsupported_field")
        if value not in _OFF_VALUES[name]:
            raise ApiError(
                400,
                f"{name}: not supported by ragsnap (it answers from documents with citations)",
                param=name,
                code="unsupported_field",
            )


def message_texts(body: ChatCompletionRequest) -> list[ChatMessageText]:
    """Roles and texts; ``developer`` is ``system``; tool traffic is refused."""
    out: list[ChatMessageText] = []
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        extra = message.model_extra or {}
        if message.role == "tool" or extra.get("tool_calls") or extra.get("function_call"):
            raise ApiError(
                400, f"{where}: tool messages and tool calls are not supported", param=where
            )
        role = "system" if message.role == "developer" else message.role
        out.append(ChatMessageText(role, message.text()))  # type: ignore[arg-type]
    return out


def parse_chat(body: ChatCompletionRequest, settings: Settings) -> ParsedChat:
    try:
        parsed = parse_messages(message_texts(body))
    except InputError as exc:
        raise ApiError(400, exc.message, param=exc.field or "messages") from None
    if len(parsed.question) > settings.max_question_chars:
        raise ApiError(
            413,
            f"messages: the question is longer than {settings.max_question_chars} characters",
            param="messages",
            code="question_too_long",
        )
    return parsed


def conversation(parsed: ParsedChat, settings: Settings) -> ChatContext | None:
    """Instructions and earlier turns, once :func:`chat_documents` decided what the
    system text is (context or instructions)."""
    return chat_context(parsed.instructions, parsed.history, settings, param="messages")


def chat_documents(
    body: ChatCompletionRequest,
    parsed: ParsedChat,
    services: Services,
    settings: Settings,
) -> list[Document]:
    """The body's documents, else the messages' context, else a corpus search with the
    conversation's standalone question (no passage found: an answer over none; with no
    corpus and no documents anywhere, an answer over none too, not grounded)."""
    given: list[Document] | None = None
    if body.documents is not None or body.query is not None:
        given = resolve_documents(body, services, settings)
    elif services.index is not None and not parsed.context_labelled:
        given = services.index.retrieve(
            parsed.retrieval_query(), check_top_k(body.top_k or settings.default_top_k, settings)
        )
    elif body.top_k is not None:
        check_top_k(body.top_k, settings)
    documents = parsed.documents(given, required=False)
    if given is None:  # from the messages: the same limits as documents in the body
        inline_documents(
            [DocumentIn(id=d.id, title=d.title, text=d.text) for d in documents], settings
        )
    return documents


def citation_annotations(answer: str, citations: Sequence[Citation]) -> list[dict[str, Any]]:
    """One ``url_citation`` per ``[n]`` marker of a cited document, with its offsets, and
    for a document cited by attribution alone, one per answer sentence it supports."""
    by_index = {c.index: c for c in citations}
    out: list[dict[str, Any]] = []
    marked: set[int] = set()
    start = 0
    while (open_at := answer.find("[", start)) >= 0:
        close = answer.find("]", open_at)
        if close < 0:
            break
        for number in cited_indices(answer[open_at : close + 1]):
            if number in by_index:
                marked.add(number)
                out.append(_url_citation(by_index[number], open_at, close + 1))
        start = close + 1
    sentences = split_sentences(answer)
    for citation in citations:
        if citation.index not in marked:
            out += [
                _url_citation(citation, sentences[i].start, sentences[i].end)
                for i in citation.sentences
                if i < len(sentences)
            ]
    return out


def _url_citation(citation: Citation, start: int, end: int) -> dict[str, Any]:
    return {
        "type": "url_citation",
        "url_citation": {
            "start_index": start,
            "end_index": end,
            "title": citation.title or citation.doc_id,
            "url": f"ragsnap:doc/{citation.doc_id}",
        },
    }


def citation_logprobs(citations: list[dict[str, Any]]) -> dict[str, Any]:
    """The choice ``logprobs`` object: no token logprobs, the citations alongside."""
    return {"content": None, "refusal": None, "ragsnap_citations": citations}


def sources_text(citations: Sequence[Citation]) -> str:
    """The ``Sources:`` list appended to the answer when a request asks for it."""
    if not citations:
        return ""
    lines = [f"[{c.index}] {c.title or c.doc_id} ({c.doc_id})" for c in citations]
    return "\n\nSources:\n" + "\n".join(lines)


def usage(stats: AnswerStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
    }
