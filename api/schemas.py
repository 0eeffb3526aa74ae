"""Request and response bodies (pydantic v2). Fixed sanity caps live here; the limits an
operator configures (:class:`api.settings.Settings`) are checked in :mod:`api.requests`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# hard caps, whatever the settings say (the configurable limits are tighter)
_MAX_ID = 256
_MAX_TITLE = 1_000
_MAX_TEXT = 10_000_000


class DocumentIn(BaseModel):
    """A document given with the request; ``id`` defaults to its position (``"1"``, ``"2"``...)."""

    model_config = ConfigDict(extra="forbid")

    id: str | int | None = Field(default=None, description="stable id, echoed in citations")
    title: str = Field(default="", max_length=_MAX_TITLE)
    text: str = Field(min_length=1, max_length=_MAX_TEXT)

    @field_validator("id")
    @classmethod
    def _id_shape(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str) and not 1 <= len(value) <= _MAX_ID:
            raise ValueError(f"must be 1 to {_MAX_ID} characters")
        return value

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class CompressionIn(BaseModel):
    """How to compress the prompt's KV cache (see ``ragsnap.compression``)."""

    model_config = ConfigDict(extra="forbid")

    press: str | None = Field(
        default=None, min_length=1, max_length=64, description="default: ragsnap's default press"
    )
    budget: int | None = Field(
        default=None, ge=1, le=1_000_000, description="tokens kept per KV head"
    )
    ratio: float | None = Field(default=None, gt=0, le=1, description="share of the prompt kept")
    window: int | None = Field(default=None, ge=1, le=4096)
    kernel: int | None = Field(default=None, ge=1, le=257)
    pooling: Literal["max", "avg"] | None = None

    @model_validator(mode="after")
    def _one_size(self) -> CompressionIn:
        if self.budget is not None and self.ratio is not None:
            raise ValueError("give budget or ratio, not both")
        return self


class CitationsIn(BaseModel):
    """How the answer is cited (see ``ragsnap.citations``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["attribution", "markers"] = Field(
        default="attribution", description="evidence-based attribution, or model markers only"
    )
    marker_control: bool = Field(default=True, description="only given numbers may follow '['")
    inline_markers: bool = Field(
        default=False, description="answer_with_markers: [n] after each supported sentence"
    )


class RetrievalFields(BaseModel):
    """Where the documents come from: given inline, or found by ``query`` in the corpus."""

    documents: list[DocumentIn] | None = Field(default=None, max_length=10_000)
    query: str | None = Field(
        default=None, min_length=1, max_length=4_000, description="search the corpus"
    )
    top_k: int | None = Field(
        default=None, ge=1, le=1_000, description="passages taken from the corpus"
    )
    compression: CompressionIn | None = None


class AnswerRequest(RetrievalFields):
    """``POST /v1/answer``."""

    model_config = ConfigDict(extra="forbid")

    citations: CitationsIn | None = None
    question: str = Field(min_length=1, max_length=1_000_000)
    max_new_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(default=0.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stream: bool = False

    @field_validator("question")
    @classmethod
    def _question_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class AnswerResponse(BaseModel):
    """The non-streaming answer: the same content as the ``meta`` and ``done`` events."""

    answer: str
    citations: list[dict[str, Any]]
    meta: dict[str, Any]
    stats: dict[str, Any]
    answer_with_markers: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(RetrievalFields):
    """``POST /v1/chat/completions``: OpenAI's body; ragsnap's fields ride along as extra
    body fields (``documents`` | ``query``/``top_k``, ``compression``). OpenAI fields that
    do not apply (tools, logprobs...) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)

    def question(self) -> str:
        """The last user message: ragsnap answers one question per request."""
        for message in reversed(self.messages):
            if message.role == "user":
                return message.text()
        return ""
