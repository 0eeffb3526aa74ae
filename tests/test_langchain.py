"""ChatRagSnap (in-process and remote), the ragsnap retriever and the RAG runnable."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage

from ragsnap.errors import InputError
from ragsnap.integrations.langchain.chat import ChatRagSnap
from ragsnap.integrations.langchain.rag import cited_documents, make_rag_chain
from ragsnap.integrations.langchain.retriever import RagSnapRetriever, from_langchain_documents
from tests.api_helpers import FAST, running_server

QUESTION = "What causes tides?"
DOCS = [
    LCDocument(
        page_content="Honeybees dance to show where flowers are.",
        metadata={"title": "Bees"},
        id="bees",
    ),
    LCDocument(
        page_content="Tides are caused by the gravity of the Moon.",
        metadata={"title": "Tides"},
        id="tides",
    ),
]


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("lc-corpus")
    (corpus / "tides.md").write_text(
        "Tides are caused by the gravity of the Moon pulling the oceans."
    )
    (corpus / "bees.md").write_text("Honeybees dance to show the hive where flowers are.")
    return RagSnapRetriever.from_directory(corpus, k=1)


@pytest.fixture(scope="module")
def chat(engine):
    return ChatRagSnap(engine=engine, compression=FAST, max_new_tokens=6)


def check_final_metadata(message, prompt_ids):
    meta = message.response_metadata
    assert isinstance(meta["citations"], list)
    assert meta["cache"] in {"off", "miss", "hit", "prefix-hit", "unavailable"}
    assert meta["kept_tokens"] == FAST["budget"] < meta["prompt_tokens"]
    assert [d["id"] for d in meta["documents"]] == prompt_ids
    assert meta["ragsnap"]["press"] == "snapkv"
    assert message.usage_metadata["input_tokens"] == meta["prompt_tokens"]
    assert 1 <= message.usage_metadata["output_tokens"] <= 6


def test_invoke_and_stream_give_the_same_answer_and_metadata(chat):
    message = chat.invoke(QUESTION, documents=DOCS)
    assert message.content.strip()
    check_final_metadata(message, ["bees", "tides"])

    chunks = list(chat.stream([HumanMessage(QUESTION)], documents=DOCS))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert len(chunks) >= 2 and chunks[-1].chunk_position == "last"
    assert not any(c.response_metadata.get("citations") is not None for c in chunks[:-1])
    assert "".join(c.content for c in chunks) == message.content  # greedy: same tokens
    merged = sum(chunks[1:], chunks[0])
    check_final_metadata(merged, ["bees", "tides"])


def test_astream_with_a_bound_retriever(engine, retriever):
    chat = ChatRagSnap(engine=engine, retriever=retriever, compression=FAST, max_new_tokens=4)

    async def collect():
        return [chunk async for chunk in chat.astream(QUESTION)]

    chunks = asyncio.run(collect())
    assert "".join(c.content for c in chunks).strip()
    check_final_metadata(chunks[-1], ["tides.md#1"])


def test_rag_chain_returns_cited_documents(engine, retriever):
    chat = ChatRagSnap(engine=engine, compression=FAST, max_new_tokens=4)
    result = make_rag_chain(retriever, chat).invoke(QUESTION)
    assert [d.id for d in result["documents"]] == ["tides.md#1"]
    assert result["answer"].strip()
    cited_ids = {c["doc_id"] for c in result["citations"]}
    assert {d.id for d in result["cited_documents"]} == cited_ids & {"tides.md#1"}


def test_cited_documents_follow_the_citation_ids():
    docs = [
        LCDocument(page_content="a", id="x"),
        LCDocument(page_content="b"),
        LCDocument(page_content="c", id="x"),
    ]
    assert [d.id for d in from_langchain_documents(docs)] == ["x", "2", "x~2"]
    citations = [
        {"index": 3, "doc_id": "x~2"},
        {"index": 2, "doc_id": "2"},
        {"index": 9, "doc_id": "gone"},
    ]
    assert cited_documents(citations, docs) == [docs[2], docs[1]]


def test_bad_setup_and_inputs_are_clear_errors(engine):
    with pytest.raises(ValueError, match="exactly one"):
        ChatRagSnap()
    chat = ChatRagSnap(engine=engine, max_new_tokens=2)
    with pytest.raises(InputError, match="no documents"):
        chat.invoke(QUESTION)
    with pytest.raises(InputError, match="last user message"):
        chat.invoke([HumanMessage("   ")], documents=DOCS)


def check_document_order(chat: ChatRagSnap) -> None:
    """Reversed DOCS (tides first) go by relevance unless the given order is asked for."""
    reversed_docs = list(reversed(DOCS))
    for order, expected in (("relevance", ["bees", "tides"]), ("given", ["tides", "bees"])):
        ordered = chat.model_copy(update={"document_order": order})
        message = ordered.invoke(QUESTION, documents=reversed_docs)
        assert [d["id"] for d in message.response_metadata["documents"]] == expected


def test_local_chat_model_orders_documents_as_asked(engine):
    check_document_order(ChatRagSnap(engine=engine, compression=FAST, max_new_tokens=2))


def test_remote_chat_model_against_a_server(engine):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    app = create_app(Settings(api_keys="lc-key"), engine=engine)
    with running_server(app) as url:
        chat = ChatRagSnap(base_url=url, api_key="lc-key", compression=FAST, max_new_tokens=4)

        async def collect():
            return [chunk async for chunk in chat.astream(QUESTION, documents=DOCS)]

        chunks = asyncio.run(collect())
        assert "".join(c.content for c in chunks).strip()
        check_final_metadata(chunks[-1], ["bees", "tides"])
        message = chat.invoke(QUESTION, documents=DOCS)
        assert message.content == "".join(c.content for c in chunks)
        # stop and the conversation travel to the server (/v1/answer: stop, instructions, history)
        full = message.content
        assert len(full) >= 4
        cut = chat.invoke(QUESTION, documents=DOCS, stop=[full[2:4]])
        assert cut.content == full[: full.index(full[2:4])]
        turns = [
            SystemMessage("Be brief."),
            HumanMessage("What do bees do?"),
            AIMessage("They dance [1]."),
            HumanMessage(QUESTION),
        ]
        multi = chat.invoke(turns, documents=DOCS)
        assert multi.response_metadata["prompt_tokens"] > message.response_metadata["prompt_tokens"]
        assert [d["id"] for d in multi.response_metadata["documents"]] == ["bees", "tides"]
        check_document_order(chat)
        with pytest.raises(InputError) as info:
            ChatRagSnap(base_url=url, api_key="wrong").invoke(QUESTION, documents=DOCS)
        assert "401" in str(info.value)
        with pytest.raises(InputError) as info:
            ChatRagSnap(base_url=url, api_key="lc-key", compression={"press": "zip"}).invoke(
                QUESTION, documents=DOCS
            )
        assert info.value.field == "compression.press"


# -- LangChain conventions: context in the messages, multi-turn chat, stop, unsupported features


def lcel_chain(retriever, chat):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    def format_docs(docs):  # the tutorials' own helper: text joined by blank lines
        return "\n\n".join(d.page_content for d in docs)

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer based only on the following context:\n{context}"),
            ("human", "{question}"),
        ]
    )
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | chat
        | StrOutputParser()
    )


def test_the_canonical_lcel_chain_answers_from_the_context(engine, retriever):
    from langchain_core.callbacks import BaseCallbackHandler

    seen: list = []

    class Capture(BaseCallbackHandler):
        def on_llm_end(self, response, **kwargs):
            seen.append(response.generations[0][0].message)

    chat = ChatRagSnap(engine=engine, compression=FAST, max_new_tokens=6)
    answer = lcel_chain(retriever, chat).invoke(QUESTION, {"callbacks": [Capture()]})
    assert isinstance(answer, str) and answer.strip()
    # the retrieved passage became the prompt's one document
    meta = seen[0].response_metadata
    assert [d["id"] for d in meta["documents"]] == ["1"]
    assert meta["prompt_tokens"] > 40


def test_ragsnap_format_docs_keeps_ids_through_the_messages(engine):
    from langchain_core.messages import SystemMessage

    from ragsnap.integrations.langchain import format_docs

    chat = ChatRagSnap(engine=engine, compression=FAST, max_new_tokens=4)
    message = chat.invoke([SystemMessage(f"Context:\n{format_docs(DOCS)}"), HumanMessage(QUESTION)])
    meta = message.response_metadata
    assert [(d["id"], d["title"]) for d in meta["documents"]] == [
        ("bees", "Bees"),
        ("tides", "Tides"),
    ]


def test_multi_turn_history_reaches_the_prompt_and_the_retriever(engine, tmp_path):
    from langchain_core.messages import AIMessage, SystemMessage

    (tmp_path / "penicillin.md").write_text("Alexander Fleming discovered penicillin in 1928.")
    (tmp_path / "tides.md").write_text("Tides follow the Moon.")
    queries: list[str] = []
    bm25 = RagSnapRetriever.from_directory(tmp_path, k=1)

    class Spy(RagSnapRetriever):
        def _get_relevant_documents(self, query, *, run_manager, k=None):
            queries.append(query)
            return super()._get_relevant_documents(query, run_manager=run_manager, k=k)

    spy = Spy(index=bm25.index, k=1)
    chat = ChatRagSnap(engine=engine, retriever=spy, compression=FAST, max_new_tokens=4)
    first = [HumanMessage("Who discovered penicillin?")]
    one = chat.invoke(first)
    follow_up = [
        SystemMessage("Answer in one word."),
        *first,
        AIMessage("Alexander Fleming [1]."),
        HumanMessage("In which year?"),
    ]
    two = chat.invoke(follow_up)
    # the follow-up alone names nothing; the standalone query still finds penicillin
    assert queries[-1] == "Who discovered penicillin? In which year?"
    assert [d["id"] for d in two.response_metadata["documents"]] == ["penicillin.md#1"]
    # instructions and the earlier turns made the prompt longer than the question alone
    extra = two.response_metadata["prompt_tokens"] - one.response_metadata["prompt_tokens"]
    assert extra >= len(engine.tokenizer("Alexander Fleming [1]. Answer in one word.")["input_ids"])
    rewritten = ChatRagSnap(
        engine=engine,
        retriever=spy,
        standalone_question=lambda messages: "penicillin discovery year",
        compression=FAST,
        max_new_tokens=2,
    )
    rewritten.invoke(follow_up)
    assert queries[-1] == "penicillin discovery year"


def test_stop_cuts_the_answer(chat):
    full = chat.invoke(QUESTION, documents=DOCS).content
    assert len(full) >= 4
    stop = full[2:4]  # occurs in the greedy answer, after its first two characters
    cut = chat.invoke(QUESTION, documents=DOCS, stop=[stop])
    assert cut.content == full[: full.index(stop)]
    assert cut.response_metadata["ragsnap"]["stop_sequence"] == stop
    assert cut.response_metadata["finish_reason"] == "stop"
    bound = ChatRagSnap(engine=chat.engine, compression=FAST, max_new_tokens=6, stop=[stop])
    chunks = list(bound.stream(QUESTION, documents=DOCS))
    assert "".join(c.content for c in chunks) == cut.content


def test_unsupported_features_fail_when_bound_and_tracing_names_the_model(chat):
    from pydantic import BaseModel

    class Answer(BaseModel):
        text: str

    with pytest.raises(NotImplementedError, match="tool calling"):
        chat.bind_tools([Answer])
    with pytest.raises(NotImplementedError, match="structured output"):
        chat.with_structured_output(Answer)
    with pytest.raises(InputError, match="unsupported argument"):
        chat.invoke(QUESTION, documents=DOCS, tools=[{"type": "function"}])
    params = chat._get_ls_params()
    assert params["ls_model_name"] == chat.engine.loaded.model_id
    assert params["ls_provider"] == "ragsnap" and params["ls_max_tokens"] == 6


def test_a_retriever_that_finds_nothing_still_gets_an_answer(engine, retriever):
    chat = ChatRagSnap(engine=engine, retriever=retriever, compression=FAST, max_new_tokens=4)
    message = chat.invoke("zzzz qqqq?")  # no passage matches
    assert message.response_metadata["documents"] == []
    assert message.content.strip()
