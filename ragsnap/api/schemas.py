"""Request and response bodies (pydantic v2). Fixed sanity caps live here; the limits an
operator configures (:class:`ragsnap.api.settings.Settings`) are checked in :mod:`api.requests`."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

from ragsnap.engine.json_body import JsonBody
from ragsnap.engine.press_settings import PressOverrides
from ragsnap.prompt.assembly import DocumentOrder
from ragsnap.runtime.generation import GREEDY_BELOW, MAX_TEMPERATURE, SEED_MAX, SEED_MIN

# hard caps, whatever the settings say (the configurable limits are tighter)
_MAX_ID = 256
_MAX_TITLE = 1_000
_MAX_TEXT = 10_000_000
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_surrogates(value: str) -> str:
    # JSON may escape a lone UTF-16 surrogate ("\\ud800"): not a character, not encodable
    if _SURROGATE.search(value):
        raise ValueError("contains a lone UTF-16 surrogate (not valid Unicode text)")
    return value


Text = Annotated[str, AfterValidator(_no_surrogates)]
# a signed 64-bit integer; the exclusive bound says 2**63 is out for readers that take
# 2**63-1 for the double 2**63 (api.openapi writes the bounds as exact integers)
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, lt=SEED_MAX + 1)]


def _not_only(spaces: str) -> JsonDict:
    """A pattern: some character not in ``spaces`` (written as ``\\uXXXX`` ranges)."""
    runs: list[list[int]] = []
    for code in sorted(map(ord, spaces)):
        if runs and runs[-1][1] == code - 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])
    ranges = "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in runs)
    return {"pattern": f"[^{ranges}]"}


# what the schema says of a text that must hold more than whitespace, as ``str.strip``
# (the validators) sees it: Python's whitespace, which is not JSON Schema's ``\\s``
# (every such character is at most U+3000)
NOT_BLANK = _not_only("".join(chr(c) for c in range(0x3001) if chr(c).isspace()))
TEMPERATURE = (
    f"sampling temperature, 0 to {MAX_TEMPERATURE:g}; below {GREEDY_BELOW:g} decodes greedily"
)
TOP_P = "nucleus sampling: the smallest set of tokens whose probability reaches top_p (the most likely always stays)"
SEED = "sampling seed, a signed 64-bit integer (-2**63 to 2**63-1)"
UNSUPPORTED = (
    "an answer its quotes do not back: flag it (grounded: false) or abstain (the answer "
    "becomes the server's abstain_text, the model's kept as model_answer; streamed tokens "
    "are never changed); default: the server's setting"
)


class DocumentIn(JsonBody):
    """A document given with the request; ``id`` defaults to its position (``"1"``, ``"2"``...)."""

    model_config = ConfigDict(extra="forbid")

    id: Text | Int64 | None = Field(
        default=None,
        description="stable id, echoed in citations. An id given twice: the same document "
        "again (same title, text and format) counts once; another document keeps its place "
        "and is cited as `<id>~2` (then `~3`...)",
        json_schema_extra={"minLength": 1, "maxLength": _MAX_ID},  # a text id: _id_shape
    )
    title: Text = Field(default="", max_length=_MAX_TITLE)
    text: Text = Field(min_length=1, max_length=_MAX_TEXT, json_schema_extra=NOT_BLANK)
    format: Literal["json", "jsonl", "xml", "html", "markdown", "csv", "text"] | None = Field(
        default=None,
        description="how the text is structured (role-conditioned presses); omitted: detected",
    )

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


class CompressionIn(PressOverrides):
    """How to compress the prompt's KV cache (see ``ragsnap.compression``): the press
    settings a request may change, declared with their bounds once
    (:class:`ragsnap.engine.press_settings.PressSettings`); unset fields take the server's."""


class CitationsIn(JsonBody):
    """How the answer is cited (see ``ragsnap.citations``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["attribution", "markers"] = Field(
        default="attribution", description="evidence-based attribution, or model markers only"
    )
    marker_control: bool = Field(default=True, description="only given numbers may follow '['")
    inline_markers: bool = Field(
        default=False, description="answer_with_markers: [n] after each supported sentence"
    )


class RetrievalFields(JsonBody):
    """Where the documents come from: given inline, or found by ``query`` in the corpus."""

    documents: list[DocumentIn] | None = Field(
        default=None, max_length=10_000, json_schema_extra={"minItems": 1}
    )
    query: Text | None = Field(
        default=None,
        min_length=1,
        max_length=4_000,
        description="search the corpus; a query no passage matches gets an answer over no "
        "documents (not grounded: grounded is false)",
        json_schema_extra=NOT_BLANK,
    )
    top_k: int | None = Field(
        default=None, ge=1, le=1_000, description="passages taken from the corpus"
    )
    compression: CompressionIn | None = None
    document_order: DocumentOrder | None = Field(
        default=None,
        description="relevance: the documents by BM25 relevance to the question, the most "
        "relevant last, next to the question; given: as sent (the document prefix, and so "
        "its cache entry, is then the same for every question); stable: by relevance the "
        "first time the document set is seen, then as that first time (later questions "
        "meet its cache entry); unset: the server's document_order setting",
    )


class TurnIn(JsonBody):
    """An earlier turn of the conversation."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Text = Field(max_length=100_000)


# as GenerationConfig checks them: at most 4 strings of 1 to 256 characters
_STOP: JsonDict = {"type": "string", "minLength": 1, "maxLength": 256}
StopIn = Annotated[
    str | list[str] | None,
    WithJsonSchema(
        {"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": 4}, {"type": "null"}]}
    ),
]


# documents and a corpus query exclude each other (the server answers 422 to both)
NOT_BOTH: JsonDict = {
    "not": {
        "required": ["documents", "query"],
        "properties": {"documents": {"type": "array"}, "query": {"type": "string"}},
    }
}


class AnswerRequest(RetrievalFields):
    """``POST /v1/answer``. ``instructions`` and ``history`` (a chat's own instructions and
    earlier turns) go into the prompt before the question; ``stop`` cuts the answer;
    ``citations`` chooses how the answer is attributed to documents. ``documents`` or
    ``query``: exactly one."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"required": ["documents"], "properties": {"documents": {"type": "array"}}},
                {"required": ["query"], "properties": {"query": {"type": "string"}}},
            ],
            **NOT_BOTH,
        },
    )

    instructions: Text | None = Field(default=None, max_length=100_000)
    history: list[TurnIn] | None = Field(default=None, max_length=256)
    stop: StopIn = None
    citations: CitationsIn | None = None
    unsupported: Literal["flag", "abstain"] | None = Field(
        default=None,
        description=UNSUPPORTED,
    )

    question: Text = Field(min_length=1, max_length=1_000_000, json_schema_extra=NOT_BLANK)
    max_new_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(
        default=0.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False, description=TEMPERATURE
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description=TOP_P)
    seed: Int64 | None = Field(default=None, description=SEED)
    stream: bool = False
    kept_tokens: bool = Field(
        default=False,
        description="the done event (or the JSON answer) carries, per document, each token's "
        "character span and the share of layers and KV heads that kept it",
    )

    @field_validator("question")
    @classmethod
    def _question_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class KeptSpanOut(BaseModel):
    """A document token: ``text[start:end]``; ``share`` of (layer, KV head) pairs kept it."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    share: float = Field(ge=0, le=1)


class DocumentKeptTokensOut(BaseModel):
    """The kept-token map of document ``index`` (1-based, as cited); ``spans`` cover its
    tokens in the prompt (bounded by ``max_document_tokens``)."""

    index: int = Field(ge=1)
    doc_id: str
    kept_share: float = Field(ge=0, le=1)
    spans: list[KeptSpanOut]


class AnswerResponse(BaseModel):
    """The non-streaming answer: the same content as the ``meta`` and ``done`` events."""

    answer: str
    citations: list[dict[str, Any]]
    meta: dict[str, Any]
    stats: dict[str, Any]
    answer_with_markers: str | None = None
    kept_tokens: list[DocumentKeptTokensOut] | None = Field(
        default=None, description="with kept_tokens: true"
    )
    grounded: bool | None = Field(
        default=None, description="the quotes back the answer (None: nothing to check)"
    )
    grounded_score: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="share of the answer's claims its quotes back (with a calibrated "
        "likelihood rule: its probability)",
    )
    unsupported_sentences: list[list[int]] = Field(
        default_factory=list, description="[start, end] of answer sentences no quote backs"
    )
    not_in_documents: list[str] = Field(
        default_factory=list,
        description="the question's numbers and names no document mentions (then the "
        "answer is not grounded)",
    )
    answer_not_in_documents: list[str] = Field(
        default_factory=list,
        description="the answer's numbers, dates and names no document mentions (then it "
        "is not grounded: an answer from the model's own knowledge)",
    )
    model_answer: str | None = Field(
        default=None, description="the model's answer, when unsupported=abstain replaced it"
    )


class SearchRequest(JsonBody):
    """``POST /v1/search``: the corpus passages ``query`` finds (what ``query`` on
    ``/v1/answer`` would put into the prompt)."""

    model_config = ConfigDict(extra="forbid")

    query: Text = Field(min_length=1, max_length=4_000, json_schema_extra=NOT_BLANK)
    top_k: int | None = Field(default=None, ge=1, le=1_000)


class PassageOut(BaseModel):
    id: str
    title: str
    text: str
    score: float


class SearchResponse(BaseModel):
    passages: list[PassageOut]


class TextPart(JsonBody):
    type: Literal["text"]
    text: Text = Field(max_length=_MAX_TEXT)


# a user message's content: text with more than whitespace, as a string or in some part
USER_TEXT: JsonDict = {
    "anyOf": [
        {"type": "string", **NOT_BLANK},
        {
            "type": "array",
            "contains": {
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string", **NOT_BLANK}},
            },
        },
    ]
}
ROLE_USER: JsonDict = {
    "type": "object",
    "required": ["role"],
    "properties": {"role": {"const": "user"}},
}


def _message_schema(schema: dict[str, Any]) -> None:
    """Tool messages and tool calls are refused (400): the schema offers none. A user
    message holds text (a blank one is refused: 400)."""
    properties = schema["properties"]
    properties["role"]["enum"] = [r for r in properties["role"]["enum"] if r != "tool"]
    for name in ("tool_calls", "function_call"):
        properties[name] = {"enum": [None, False, 0, "", [], {}], "description": "not supported"}
    schema["if"] = ROLE_USER
    schema["then"] = {"required": ["content"], "properties": {"content": USER_TEXT}}


class ChatMessage(JsonBody):
    model_config = ConfigDict(extra="allow", json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(
        default=None,
        max_length=_MAX_TEXT,
        description="a user message's: text with more than whitespace",
    )

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    @model_validator(mode="after")
    def _user_text(self) -> ChatMessage:
        if self.role == "user" and not self.text().strip():
            raise ValueError("a user message must hold text (more than whitespace)")
        return self


class StreamOptions(JsonBody):
    include_usage: bool = False


class ChatCompletionRequest(RetrievalFields):
    """``POST /v1/chat/completions``: OpenAI's body; ragsnap's fields ride along as extra
    body fields (``documents`` | ``query``/``top_k``, ``compression``, ``sources``). Other
    fields are kept in ``model_extra`` and refused unless they hold their "off" value
    (:func:`ragsnap.api.openai_serving.refuse_unsupported`)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=NOT_BOTH)

    model: Text = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(
        min_length=1,
        max_length=256,
        description="at least one user message (the last one holds the question)",
        json_schema_extra={"contains": ROLE_USER},
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(
        default=None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False, description=TEMPERATURE
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description=TOP_P)
    seed: Int64 | None = Field(default=None, description=SEED)
    n: int | None = Field(default=None, ge=1, le=1, description="one choice per request")
    stop: StopIn = None
    sources: bool = Field(default=False, description="append a Sources: list to the answer")
    unsupported: Literal["flag", "abstain"] | None = Field(
        default=None,
        description=UNSUPPORTED,
    )
