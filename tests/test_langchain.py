"""ChatRagSnap (in-process and remote), the ragsnap retriever and the RAG runnable."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessageChunk, HumanMessage

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
    return RagSnapRetriever.from_directory(corpus, top_k=1)


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
    with pytest.raises(InputError, match="human message"):
        chat.invoke([HumanMessage("   ")], documents=DOCS)


def test_remote_chat_model_against_a_server(engine):
    from api.app import create_app
    from api.settings import Settings

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
        with pytest.raises(InputError) as info:
            ChatRagSnap(base_url=url, api_key="wrong").invoke(QUESTION, documents=DOCS)
        assert "401" in str(info.value)
        with pytest.raises(InputError) as info:
            ChatRagSnap(base_url=url, api_key="lc-key", compression={"press": "zip"}).invoke(
                QUESTION, documents=DOCS
            )
        assert info.value.field == "compression.press"
