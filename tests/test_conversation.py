"""Chat messages to question, instructions, history and documents (ragsnap.prompt.chat)."""

from __future__ import annotations

import pytest

from ragsnap.errors import InputError
from ragsnap.prompt.chat import (
    ChatMessageText,
    documents_from_context,
    format_docs,
    parse_messages,
)
from ragsnap.prompt.documents import Document

TIDES = "Tides are caused by the gravity of the Moon."
BEES = "Honeybees dance to show where flowers are."


def msgs(*pairs: tuple[str, str]) -> list[ChatMessageText]:
    return [ChatMessageText(role, text) for role, text in pairs]  # type: ignore[arg-type]


def test_a_system_context_label_splits_on_blank_lines():
    parsed = parse_messages(
        msgs(
            ("system", f"Answer based only on the following context:\n{TIDES}\n\n{BEES}"),
            ("user", "What causes tides?"),
        )
    )
    assert parsed.question == "What causes tides?"
    assert [(d.id, d.text) for d in parsed.documents(None)] == [("1", TIDES), ("2", BEES)]
    assert parsed.instructions == "Answer based only on the following context:"


def test_the_rag_prompt_layout_in_one_user_message():
    text = (
        "You are an assistant for question-answering tasks. Use the retrieved context.\n"
        f"Question: What causes tides? \nContext: {TIDES}\n\n{BEES} \nAnswer:"
    )
    parsed = parse_messages(msgs(("user", text)))
    assert parsed.question == "What causes tides?"
    assert [d.text for d in parsed.documents(None)] == [TIDES, BEES]
    assert parsed.instructions.startswith("You are an assistant")
    assert "Answer:" not in parsed.instructions and "Question" not in parsed.instructions


def test_format_docs_round_trips_ids_titles_and_paragraphs():
    docs = [
        Document(id="tides", title="Tides", text=f"{TIDES}\n\nA second paragraph."),
        Document(id="bees", title="", text=BEES),
    ]
    back = documents_from_context(format_docs(docs))
    assert [(d.id, d.title, d.text) for d in back] == [(d.id, d.title, d.text) for d in docs]


def test_history_instructions_and_the_retrieval_query():
    parsed = parse_messages(
        msgs(
            ("system", "You are terse."),
            ("user", "Who discovered penicillin?"),
            ("assistant", "Alexander Fleming [1]."),
            ("user", "In which year?"),
        )
    )
    assert parsed.question == "In which year?"
    assert parsed.instructions == "You are terse."
    assert [(t.role, t.text) for t in parsed.history] == [
        ("user", "Who discovered penicillin?"),
        ("assistant", "Alexander Fleming [1]."),
    ]
    assert parsed.retrieval_query() == "Who discovered penicillin? In which year?"
    given = [Document(id="p", text="Fleming found penicillin in 1928.")]
    assert parsed.documents(given) == given  # no context in the messages: the given ones
    assert parsed.instructions == "You are terse."


def test_unlabelled_system_text_is_the_context_only_without_other_documents():
    pairs = (("system", f"{TIDES}\n\n{BEES}"), ("user", "What causes tides?"))
    parsed = parse_messages(msgs(*pairs))
    assert [d.text for d in parsed.documents(None)] == [TIDES, BEES]
    assert parsed.instructions == ""
    again = parse_messages(msgs(*pairs))
    assert again.documents([]) == [] and again.instructions.startswith("Tides")


def test_messages_without_documents_or_question_are_clear_errors():
    with pytest.raises(InputError, match="no documents"):
        parse_messages(msgs(("user", "What causes tides?"))).documents(None)
    with pytest.raises(InputError, match="last user message"):
        parse_messages(msgs(("system", "x"), ("assistant", "y")))
    with pytest.raises(InputError, match="no question"):
        parse_messages(msgs(("user", f"Context: {TIDES}")))
    # repeated ids from two context sections stay distinct
    parsed = parse_messages(
        msgs(("system", f"Context: {TIDES}"), ("user", f"Context: {BEES}\nQuestion: Why?"))
    )
    assert [d.id for d in parsed.documents(None)] == ["1", "1~2"]
