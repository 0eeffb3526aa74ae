"""From chat messages to ragsnap's inputs: question, instructions, prior turns, documents.

Chat front ends (LangChain's ``ChatRagSnap``, the OpenAI route) hand ragsnap a list of
messages. How they become a ragsnap answer:

- The **question** is the last user message; when that message holds a ``Question:``
  label (as prompt templates such as ``"Question: {question}\\nContext: {context}"``
  produce), the labelled text is the question and the unlabelled text is instructions.
- **Context** is text after a context label, in a system message or the last user
  message: a line starting ``Context:`` / ``Documents:`` / ``Sources:`` (the text after
  the colon belongs to it), or a line ending in one of them ("...the following
  context:"). It lasts until the next label; a final bare ``Answer:`` is dropped.
  Context text becomes documents: split at lines holding only ``---`` when there is
  one (what :func:`format_docs` writes, so documents may hold blank lines), otherwise at
  blank lines. A piece whose first line is ``[id] title`` keeps that id and title
  (:func:`format_docs` writes them); other pieces are numbered ``1``, ``2``... in order.
- When no context label is found and the caller has no other documents, the system
  messages' text is the context (``("system", "{context}")``).
- Other system text is **instructions**; earlier user and assistant messages are the
  **history**. All of it is untrusted text in the prompt's tail (see ``ragsnap.prompt.assembly``).
- The **retrieval query** is the question preceded by the previous user turns (up to
  :data:`QUERY_TURNS`), so a follow-up ("and when?") still finds its documents.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ragsnap.errors import InputError
from ragsnap.prompt.assembly import ChatContext, Turn
from ragsnap.prompt.documents import Document

Role = Literal["system", "user", "assistant"]
DOC_SEPARATOR = "\n\n---\n\n"
QUERY_TURNS = 2  # earlier user turns that join the question in the retrieval query

_CONTEXT = r"context|documents|sources|retrieved context"
_LEADING = re.compile(rf"^\s*(?P<label>{_CONTEXT}|question)\s*:\s*(?P<rest>.*)$", re.I)
_TRAILING = re.compile(rf"^(?P<before>.*\S)\s+(?P<label>{_CONTEXT})\s*:\s*$", re.I)
_ANSWER = re.compile(r"^\s*answer\s*:\s*$", re.I)
_RULE = re.compile(r"\n[ \t]*---[ \t]*\n")
_BLANK = re.compile(r"\n[ \t]*\n")
_HEADER = re.compile(r"^\[(?P<id>[^\]\n]{1,256})\][ \t]*(?P<title>.*)$")


@dataclass(frozen=True)
class ChatMessageText:
    """A chat message reduced to what ragsnap reads: its role and its text."""

    role: Role
    text: str


@dataclass
class ParsedChat:
    """What a list of messages asks: see the module docstring for the rules."""

    question: str
    system_instructions: str = ""
    user_instructions: str = ""
    history: tuple[Turn, ...] = ()
    context: list[Document] = field(default_factory=list)
    context_labelled: bool = False  # some message had a context label

    @property
    def instructions(self) -> str:
        return "\n\n".join(t for t in (self.system_instructions, self.user_instructions) if t)

    @property
    def chat(self) -> ChatContext:
        return ChatContext(instructions=self.instructions, history=self.history)

    def retrieval_query(self) -> str:
        """The question, after the previous user turns: a standalone search query."""
        earlier = [t.text.strip() for t in self.history if t.role == "user"][-QUERY_TURNS:]
        return " ".join([*earlier, self.question])

    def documents(
        self, given: Sequence[Document] | None, *, required: bool = True
    ) -> list[Document]:
        """``given`` documents (a call's or a retriever's), then those of the messages.

        With neither, the unlabelled system text becomes the context; with none at all
        (``given is None`` and nothing in the messages) an :class:`InputError` says so,
        unless not ``required`` (then: none, an answer over no documents).
        """
        found = list(given or []) + self.context
        if not found and given is None and not self.context_labelled and self.system_instructions:
            found = documents_from_context(self.system_instructions)
            self.system_instructions = ""  # that text was the context, not instructions
        if not found and given is None and required:
            raise InputError(
                "no documents: pass documents, bind a retriever or put the context in a "
                "system or user message ('Context: ...')",
                field="documents",
            )
        return unique_ids(found)


def unique_ids(documents: Sequence[Document]) -> list[Document]:
    """``documents`` with repeated ids made unique (``~2``, ``~3``...), order kept."""
    seen: set[str] = set()
    out: list[Document] = []
    for doc in documents:
        unique, n = doc.id, 1
        while unique in seen:
            n += 1
            unique = f"{doc.id}~{n}"
        seen.add(unique)
        out.append(doc if unique == doc.id else dataclasses.replace(doc, id=unique))
    return out


def format_docs(documents: Sequence[Document]) -> str:
    """Documents as context text that :func:`documents_from_context` reads back:
    ``[id] title`` then the text, separated by ``---`` lines."""
    return DOC_SEPARATOR.join(
        f"[{d.id}] {d.title}".rstrip() + f"\n{d.text.strip()}" for d in documents
    )


def documents_from_context(text: str) -> list[Document]:
    """Context text as documents (``---`` lines, else blank lines, separate them)."""
    text = f"\n{text.strip()}\n"
    pieces = _RULE.split(text) if _RULE.search(text) else _BLANK.split(text)
    out: list[Document] = []
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        first, _, rest = piece.partition("\n")
        header = _HEADER.match(first)
        if header and rest.strip():
            doc_id, title, body = header["id"].strip(), header["title"].strip(), rest.strip()
        else:
            doc_id, title, body = str(len(out) + 1), "", piece
        out.append(Document(id=doc_id, title=title, text=body))
    return out


def _sections(text: str) -> list[tuple[str, str]]:
    """``(label, text)`` pieces of a message; label is ``""``, ``"context"`` or ``"question"``."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines():
        if _ANSWER.match(line):
            sections.append(("answer", []))
        elif leading := _LEADING.match(line):
            label = "question" if leading["label"].lower() == "question" else "context"
            sections.append((label, [leading["rest"]] if leading["rest"].strip() else []))
        elif _TRAILING.match(line):  # "...the following context:" stays an instruction
            sections[-1][1].append(line)
            sections.append(("context", []))
        else:
            sections[-1][1].append(line)
    joined = [(label, "\n".join(lines).strip()) for label, lines in sections]
    # an empty context section stays: the label says where documents were meant to go
    return [(b, t) for b, t in joined if b == "context" or (t and b != "answer")]


def parse_messages(messages: Sequence[ChatMessageText]) -> ParsedChat:
    """Split ``messages`` into question, instructions, history and context documents."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    if last_user < 0 or not messages[last_user].text.strip():
        raise InputError("the last user message is missing or empty", field="messages")
    system: list[str] = []
    context: list[str] = []
    history: list[Turn] = []
    for i, message in enumerate(messages):
        if message.role == "system":
            for label, body in _sections(message.text):
                (context if label == "context" else system).append(body)
        elif i < last_user and message.text.strip():
            history.append(Turn("user" if message.role == "user" else "assistant", message.text))
    sections = _sections(messages[last_user].text)
    questions = [body for label, body in sections if label == "question"]
    plain = [body for label, body in sections if label == ""]
    context += [body for label, body in sections if label == "context"]
    user_instructions: list[str] = []
    if questions:
        question = "\n".join(questions)
        user_instructions = plain
    else:
        question = "\n\n".join(plain)
    if not question.strip():
        raise InputError("the last user message holds no question", field="messages")
    return ParsedChat(
        question=question.strip(),
        system_instructions="\n\n".join(system),
        user_instructions="\n\n".join(user_instructions),
        history=tuple(history),
        context=[d for text in context if text for d in documents_from_context(text)],
        context_labelled=bool(context),
    )
