"""RAG helpers: ``format_docs`` and ``cited_answer`` for LCEL chains, and a small runnable (question -> any
LangChain retriever -> ragsnap answer with the cited Documents)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

from ragsnap.integrations.langchain.chat import ChatRagSnap
from ragsnap.integrations.langchain.retriever import from_langchain_documents
from ragsnap.prompt.chat import format_docs as format_ragsnap_docs


def format_docs(documents: Sequence[LCDocument]) -> str:
    """Retrieved documents as context text for a prompt template, in the layout
    ``ChatRagSnap`` reads back into documents with their ids and titles (``[id] title``,
    then the text; documents separated by ``---`` lines).

    >>> chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat  # doctest: +SKIP
    """
    return format_ragsnap_docs(from_langchain_documents(documents))


def cited_documents(
    citations: Sequence[dict[str, Any]], documents: Sequence[LCDocument]
) -> list[LCDocument]:
    """The retrieved documents the answer cites, in citation order, matched by the ids
    :func:`from_langchain_documents` gave them (so repeated or missing ids still match)."""
    by_id = {
        d.id: original
        for d, original in zip(from_langchain_documents(documents), documents, strict=True)
    }
    cited = []
    for citation in citations:
        document = by_id.get(str(citation.get("doc_id")))
        if document is not None and document not in cited:
            cited.append(document)
    return cited


def cited_answer(message: BaseMessage) -> dict[str, Any]:
    """A ragsnap reply as ``{"answer", "citations", "grounded", "grounded_score",
    "not_in_documents", "answer_not_in_documents"}``: end an
    LCEL chain with ``| cited_answer`` where ``| StrOutputParser()`` would drop them.

    >>> chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat | cited_answer  # doctest: +SKIP
    """
    metadata = message.response_metadata
    return {
        "answer": message.text,
        "citations": list(metadata.get("citations", [])),
        "grounded": metadata.get("grounded"),
        "grounded_score": metadata.get("grounded_score"),
        "not_in_documents": list(metadata.get("not_in_documents", [])),
        "answer_not_in_documents": list(metadata.get("answer_not_in_documents", [])),
    }


def _result(question: str, documents: list[LCDocument], message: BaseMessage) -> dict[str, Any]:
    metadata = dict(message.response_metadata)
    citations = list(metadata.get("citations", []))
    return {
        "question": question,
        "answer": message.text,
        "citations": citations,
        "cited_documents": cited_documents(citations, documents),
        "documents": documents,
        "response_metadata": metadata,
    }


def make_rag_chain(retriever: BaseRetriever, chat: ChatRagSnap) -> Runnable[str, dict[str, Any]]:
    """``question -> retriever -> ChatRagSnap``; the output dict holds ``answer``,
    ``citations``, ``cited_documents`` (the retrieved ``Document``s the answer cites),
    ``documents`` (all retrieved) and the chat model's ``response_metadata``.

    >>> chain = make_rag_chain(RagSnapRetriever.from_directory("docs/"), chat)  # doctest: +SKIP
    >>> chain.invoke("what causes tides?")["cited_documents"]  # doctest: +SKIP
    """

    def run(question: str, config: RunnableConfig) -> dict[str, Any]:
        documents = retriever.invoke(question, config)
        message = chat.invoke([HumanMessage(question)], config, documents=documents)
        return _result(question, documents, message)

    async def arun(question: str, config: RunnableConfig) -> dict[str, Any]:
        documents = await retriever.ainvoke(question, config)
        message = await chat.ainvoke([HumanMessage(question)], config, documents=documents)
        return _result(question, documents, message)

    return RunnableLambda(run, afunc=arun, name="ragsnap_rag")
