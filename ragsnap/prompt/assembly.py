"""Prompt assembly: system instruction, numbered documents, the question last.

The prompt is the concatenation of separately tokenized pieces (head, one piece per
document, tail), so the document prefix is the same for any question that lays the
documents out in the same order: that is what lets a cached document prefix be reused
for a new question, and it gives each document's token span without offset mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from ragsnap.errors import InputError
from ragsnap.prompt.documents import Document

# v2: user text keeps control strings as text; v3: ANSWER_STYLE (and the relevance order);
# v4: no sentence asking the model to say when the documents lack the answer
PROMPT_TEMPLATE_VERSION = "ragsnap-prompt-v4"
# The embedded model never said so with it either: at n = 50 + 50 unanswerable items it
# abstained on 1 both ways, and answerable accuracy was the same (issue 43,
# lab/results.md); the grounded verdict is what tells a reader (ragsnap.citations.lift).
SYSTEM_INSTRUCTION = (
    "Answer the question using only the numbered documents. Be brief. "
    "Cite every document you use by its number in square brackets, like [1] or [2][3]."
)
# before the question (and the chat context), unless the chat gives instructions of its
# own; with the relevance order it took the embedded model from 17 to 27 right answers of
# 40 + 40 held-out items at full cache (lab/results.md)
ANSWER_STYLE = "Answer in a few words.\n"
_SENTINEL = "\u0000RAGSNAP_USER_CONTENT\u0000"
# A document cut to fewer tokens than this is dropped instead of truncated.
MIN_TRUNCATED_TOKENS = 32
# no tokenizer of real text spends more characters than this on one token, whitespace runs aside
MAX_CHARS_PER_TOKEN = 32
# "relevance": the documents that fit, least relevant to the question first, so the most
# relevant sits next to the question (a small model reads the document nearest it);
# "given": the caller's order, which keeps the document prefix the same for any question;
# "stable": relevance for the first question over a document set, then the order that
# question gave the set (recorded in the cache: ragsnap.cache.tiers.orders), so later
# questions over it find its document prefix
DocumentOrder = Literal["relevance", "given", "stable"]
DOCUMENT_ORDERS: tuple[DocumentOrder, ...] = ("relevance", "given", "stable")
DEFAULT_DOCUMENT_ORDER: DocumentOrder = "relevance"


@dataclass(frozen=True)
class Turn:
    """One earlier turn of a conversation: who spoke and what they said."""

    role: Literal["user", "assistant"]
    text: str


@dataclass(frozen=True)
class ChatContext:
    """What a chat adds to the question: the user's own instructions and the prior turns.

    Both go into the prompt's tail, after the documents and before the question, as plain
    (untrusted) text: the document prefix stays independent of them, so a cached prefix is
    reused across conversations, and nothing a user writes can open a chat turn of its own.
    ``SYSTEM_INSTRUCTION`` stays the system message (it is what makes the model cite).
    """

    instructions: str = ""
    history: tuple[Turn, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.instructions.strip() and not self.history


def format_chat_context(chat: ChatContext, max_tokens: int, tokenizer: Any) -> str:
    """The tail text for ``chat``: ``Instructions: ...`` then ``Conversation so far:`` with
    ``User:`` / ``Assistant:`` lines, the oldest turns dropped first to fit ``max_tokens``."""
    lines: list[str] = []
    if chat.instructions.strip():
        lines.append(f"Instructions: {chat.instructions.strip()}\n\n")
    turns = [
        f"{'User' if t.role == 'user' else 'Assistant'}: {t.text.strip()}\n"
        for t in chat.history
        if t.text.strip()
    ]
    while turns:
        text = "".join([*lines, "Conversation so far:\n", *turns, "\n"])
        if len(encode_user_text(tokenizer, text)) <= max_tokens or len(turns) == 1:
            return text
        turns = turns[1:]  # the oldest turn goes first
    return "".join(lines)


@dataclass
class PromptLayout:
    """A tokenized prompt and where each part of it sits.

    ``input_ids[:prefix_len]`` depends only on the documents, their order and the template
    (the part a document-prefix cache may hold); the question and the generation prompt
    follow.
    ``doc_spans[i]`` is the ``[start, end)`` token span of ``documents[i]``, cited as ``[i+1]``.
    """

    input_ids: list[int]
    prefix_len: int
    documents: list[Document]
    doc_spans: list[tuple[int, int]]
    dropped_doc_ids: list[str] = field(default_factory=list)
    truncated_doc_ids: list[str] = field(default_factory=list)
    template_version: str = PROMPT_TEMPLATE_VERSION
    answer_prefix: str = ""
    # what is read off the prompt once per request (its token roles, its focus), by name
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def document_header(index: int, document: Document) -> str:
    """``[n] title``: the line a document's piece starts with."""
    return f"[{index}] {document.title}".rstrip()


def format_document(index: int, document: Document) -> str:
    """``[n] title`` then the text, as the model sees it."""
    return f"{document_header(index, document)}\n{document.text.strip()}\n\n"


def document_text_start(index: int, document: Document) -> int:
    """Where the document's (stripped) text starts in ``format_document(index, document)``."""
    return len(document_header(index, document)) + 1


class _Fitted(NamedTuple):
    """A document that fits: its rank, the text to format, its piece as numbered by rank."""

    rank: int
    source: Document
    piece: list[int]
    cut: bool


def _fit(
    tokenizer: Any, documents: Sequence[Document], room: int
) -> tuple[list[_Fitted], list[str], list[str]]:
    """The documents that fit in ``room`` tokens, in rank order, then the ids dropped and
    the ids truncated (only the last that fits is; every later one is dropped)."""
    fitted: list[_Fitted] = []
    dropped: list[str] = []
    truncated: list[str] = []
    for rank, document in enumerate(documents):
        if room < MIN_TRUNCATED_TOKENS:
            dropped.append(document.id)
            continue
        # a document far longer than the room left is cut before tokenizing (a 50 MB text
        # would otherwise take gigabytes); the first `room` tokens come out the same
        limit = room * MAX_CHARS_PER_TOKEN
        source = (
            replace(document, text=document.text[:limit])
            if len(document.text) > limit
            else document
        )
        piece = encode_user_text(tokenizer, format_document(rank + 1, source))
        cut = len(piece) > room or source is not document
        if cut:
            piece = piece[:room]
            truncated.append(document.id)
        fitted.append(_Fitted(rank, source, piece, cut))
        room -= len(piece)
    return fitted, dropped, truncated


def _renumbered(
    tokenizer: Any, fitted: Sequence[_Fitted], room: int
) -> tuple[list[list[int]], int | None]:
    """The pieces of ``fitted`` numbered by their place in it, within ``room`` tokens, and
    the rank of the piece cut to stay within it (None when none was)."""
    pieces = [
        f.piece
        if f.rank == n
        else encode_user_text(tokenizer, format_document(n + 1, f.source))[
            : len(f.piece) if f.cut else None
        ]
        for n, f in enumerate(fitted)
    ]
    # a number's length can differ (``[9]`` vs ``[10]``): the lowest-ranked piece gives way
    excess = sum(map(len, pieces)) - room
    if excess > 0:
        last = max(range(len(fitted)), key=lambda n: fitted[n].rank)
        pieces[last] = pieces[last][: len(pieces[last]) - excess]
        return pieces, fitted[last].rank
    return pieces, None


def _template_halves(tokenizer: Any, system: str) -> tuple[str, str]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": _SENTINEL}]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    else:  # base models: a plain layout
        rendered = f"{system}\n\n{_SENTINEL}\nAnswer:"
    before, _, after = rendered.partition(_SENTINEL)
    return before, after


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Template text: its control strings are the real special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _control_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special-token strings, longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    strings |= {str(t) for t in added.values() if getattr(t, "special", False)}
    return sorted((s for s in strings if s), key=len, reverse=True)


def _text_pieces(text: str, controls: Sequence[str]) -> list[tuple[int, str]]:
    """``text`` cut so that no piece contains a whole control string: ``(offset, piece)``.

    Each control string is cut in the middle (recursively, for a control string that
    contains another), so the pieces tokenize as plain text.
    """
    for control in controls:
        at = text.find(control)
        if at >= 0:
            half = at + max(1, len(control) // 2)
            end = at + len(control)
            left = _text_pieces(text[:half], controls)
            right = [(half + o, p) for o, p in _text_pieces(text[half:end], controls)]
            rest = [(end + o, p) for o, p in _text_pieces(text[end:], controls)]
            return left + right + rest
    return [(0, text)] if text else []


def encode_user_text(tokenizer: Any, text: str) -> list[int]:
    """Untrusted text (documents, titles, questions, messages): control strings stay text.

    Without this a document holding ``<|im_end|><|im_start|>system`` would close the user
    turn and open a system turn of its own (prompt injection). Control strings are cut so
    no piece matches them; transformers' ``split_special_tokens`` is not used because it
    flips shared tokenizer state, which races between threads.
    """
    ids: list[int] = []
    for _, piece in _text_pieces(text, _control_strings(tokenizer)):
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def encode_user_text_with_offsets(
    tokenizer: Any, text: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """:func:`encode_user_text` and each token's ``(start, end)`` character span in ``text``."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for offset, piece in _text_pieces(text, _control_strings(tokenizer)):
        encoded = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        ids += encoded["input_ids"]
        spans += [(offset + a, offset + b) for a, b in encoded["offset_mapping"]]
    return ids, spans


def assemble_prompt(
    tokenizer: Any,
    question: str,
    documents: Sequence[Document],
    *,
    max_prompt_tokens: int,
    system: str = SYSTEM_INSTRUCTION,
    answer_prefix: str = "",
    chat: ChatContext | None = None,
    relevance: Sequence[float] | None = None,
) -> PromptLayout:
    """Build the prompt for ``question`` over ``documents`` (given in rank order).

    When the documents do not fit in ``max_prompt_tokens``, the lowest-ranked ones are
    dropped and the last one that partly fits is truncated; both are reported.
    ``relevance`` (one score per document, e.g. BM25 for the question) lays the documents
    that fit out in ascending order, the most relevant last, next to the question (ties:
    the higher-ranked later); ``layout.documents`` is then that order, numbered from 1.
    ``answer_prefix`` (e.g. "The answer is") follows the generation prompt as the start
    of the model's answer: it is part of the prompt, so the observation window sees it.
    ``chat`` (instructions and prior turns) goes before the question, after the
    documents; its oldest turns are dropped when it would take over half the prompt.
    The tail opens with ``ANSWER_STYLE`` unless ``chat`` has instructions of its own.
    Without ``chat`` the prompt is exactly the template's (``PROMPT_TEMPLATE_VERSION``).
    Raises :class:`InputError` when the question alone does not fit.
    """
    question = question.strip()
    if not question:
        raise InputError("the question is empty", field="question")
    before, after = _template_halves(tokenizer, system)
    head = _encode(tokenizer, before + "Documents:\n\n")
    context = ""
    if chat is not None and not chat.empty:
        context = format_chat_context(chat, max_prompt_tokens // 2, tokenizer)
    own_style = chat is not None and bool(chat.instructions.strip())
    tail = [] if own_style else _encode(tokenizer, ANSWER_STYLE)
    tail += encode_user_text(tokenizer, f"{context}Question: {question}")
    tail += _encode(tokenizer, after)
    if answer_prefix.strip():
        tail += encode_user_text(tokenizer, answer_prefix.strip())
    room = max_prompt_tokens - len(head) - len(tail)
    if room <= 0:
        raise InputError(
            f"the question is too long: the prompt would need {len(head) + len(tail)} tokens "
            f"before any document, and at most {max_prompt_tokens} fit",
            field="question",
        )
    if relevance is not None and len(relevance) != len(documents):
        raise ValueError(f"{len(relevance)} relevance scores for {len(documents)} documents")
    fitted, dropped, truncated = _fit(tokenizer, documents, room)
    if relevance is not None:
        fitted.sort(key=lambda f: (relevance[f.rank], -f.rank))
        pieces, shortened = _renumbered(tokenizer, fitted, room)
        if shortened is not None and documents[shortened].id not in truncated:
            truncated.append(documents[shortened].id)
    else:
        pieces = [f.piece for f in fitted]
    input_ids = list(head)
    spans: list[tuple[int, int]] = []
    for piece in pieces:
        spans.append((len(input_ids), len(input_ids) + len(piece)))
        input_ids.extend(piece)
    prefix_len = len(input_ids)
    input_ids.extend(tail)
    return PromptLayout(
        input_ids=input_ids,
        prefix_len=prefix_len,
        documents=[documents[f.rank] for f in fitted],
        doc_spans=spans,
        dropped_doc_ids=dropped,
        truncated_doc_ids=truncated,
        answer_prefix=answer_prefix.strip(),
    )
