"""What an answer stream yields: typed events shared by the CLI, the API and LangChain."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ragsnap.citations import Citation
from ragsnap.citations.kept import DocumentKeptTokens
from ragsnap.engine.stats import AnswerStats


@dataclass
class MetaEvent:
    """Sent once, before the first token: what the prompt became and where it came from.
    ``kept_tokens`` is None when the first token goes out before the press compressed the
    prompt (the ``done`` event's statistics then give it)."""

    prompt_tokens: int
    kept_tokens: int | None
    cache: str
    documents: list[
        dict[str, Any]
    ]  # index (the [n] the model sees, as citations give it), id, title
    dropped_doc_ids: list[str] = field(default_factory=list)
    truncated_doc_ids: list[str] = field(default_factory=list)
    type: str = "meta"


@dataclass
class TokenEvent:
    """A piece of answer text (one or more tokens, always valid UTF-8)."""

    text: str
    type: str = "token"


@dataclass
class CitationsEvent:
    """Sent after the last token. ``answer_with_markers`` is the answer with ``[n]`` after
    each supported sentence when inline markers were asked for (the streamed tokens are
    always the model's own text), else None."""

    citations: list[Citation]
    answer_with_markers: str | None = None
    type: str = "citations"


@dataclass
class DoneEvent:
    """The last event: the full answer, its citations and every statistic;
    ``kept_tokens`` (when asked for) each document's kept-token map.

    The verdict (issue 43, ``ragsnap.citations.verdict``): ``grounded`` and
    ``grounded_score`` (None without evidence: markers mode, or nothing to check),
    ``unsupported_sentences`` (``[start, end]`` offsets into the model's answer),
    ``not_in_documents`` (the question's numbers and names no document mentions, as the
    question writes them; :mod:`ragsnap.citations.named`), ``answer_not_in_documents``
    (the answer's numbers, dates and names no document mentions, issue 53; then it is not
    grounded); when the
    request said ``unsupported: "abstain"`` and the answer was not grounded, ``answer`` is
    the abstention text and ``model_answer`` the model's own (else None)."""

    answer: str
    citations: list[Citation]
    stats: AnswerStats
    answer_with_markers: str | None = None
    kept_tokens: list[DocumentKeptTokens] | None = None
    grounded: bool | None = None
    grounded_score: float | None = None
    unsupported_sentences: list[list[int]] = field(default_factory=list)
    not_in_documents: list[str] = field(default_factory=list)
    answer_not_in_documents: list[str] = field(default_factory=list)
    model_answer: str | None = None
    type: str = "done"

    def verdict(self) -> dict[str, Any]:
        """The verdict fields, as every route serializes them."""
        return {
            "grounded": self.grounded,
            "grounded_score": self.grounded_score,
            "unsupported_sentences": self.unsupported_sentences,
            "not_in_documents": self.not_in_documents,
            "answer_not_in_documents": self.answer_not_in_documents,
            "model_answer": self.model_answer,
        }


AnswerEvent = MetaEvent | TokenEvent | CitationsEvent | DoneEvent


def event_payload(event: AnswerEvent) -> dict[str, Any]:
    """The JSON body of an event: what the ``/v1/answer`` stream sends, ``ragsnap ask
    --json`` prints and LangChain's chat model reads (one serializer for all)."""
    if isinstance(event, MetaEvent):
        return {k: v for k, v in asdict(event).items() if k != "type"}
    if isinstance(event, TokenEvent):
        return {"text": event.text}
    if isinstance(event, CitationsEvent):
        return {
            "citations": [c.to_dict() for c in event.citations],
            "answer_with_markers": event.answer_with_markers,
        }
    payload = {
        "answer": event.answer,
        "answer_with_markers": event.answer_with_markers,
        "citations": [c.to_dict() for c in event.citations],
        "stats": event.stats.to_dict(),
        **event.verdict(),  # grounded, grounded_score... (issue 43)
    }
    if event.kept_tokens is not None:  # asked for: the kept-token map of each document
        payload["kept_tokens"] = [d.to_dict() for d in event.kept_tokens]
    return payload
