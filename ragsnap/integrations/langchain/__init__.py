"""ragsnap for LangChain: ``ChatRagSnap`` (a ``BaseChatModel``), ``RagSnapRetriever`` (BM25,
a ``BaseRetriever``) and ``make_rag_chain``. Needs the ``langchain`` extra.

Names are imported lazily, so ``import ragsnap.integrations.langchain`` costs nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragsnap.integrations.langchain.chat import ChatRagSnap
    from ragsnap.integrations.langchain.rag import (
        cited_answer,
        cited_documents,
        format_docs,
        make_rag_chain,
    )
    from ragsnap.integrations.langchain.retriever import (
        RagSnapRetriever,
        from_langchain_documents,
        to_langchain_document,
    )

_EXPORTS = {
    "ChatRagSnap": "chat",
    "format_docs": "rag",
    "cited_answer": "rag",
    "cited_documents": "rag",
    "make_rag_chain": "rag",
    "RagSnapRetriever": "retriever",
    "from_langchain_documents": "retriever",
    "to_langchain_document": "retriever",
}
__all__ = [
    "ChatRagSnap",
    "RagSnapRetriever",
    "cited_answer",
    "cited_documents",
    "format_docs",
    "from_langchain_documents",
    "make_rag_chain",
    "to_langchain_document",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
