"""ragsnap's BM25 retriever as a LangChain ``BaseRetriever``, and document conversions.

Needs the ``langchain`` extra (langchain-core).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import AliasChoices, ConfigDict, Field

from ragsnap.errors import InputError
from ragsnap.prompt.documents import DOCUMENT_FORMATS, Document
from ragsnap.retrieval.bm25 import BM25Index
from ragsnap.retrieval.corpus import DEFAULT_MAX_WORDS


def to_langchain_document(document: Document) -> LCDocument:
    """A ragsnap document as LangChain's: ``id`` kept, ``title``, a declared ``format`` and
    the metadata in ``metadata``."""
    metadata = {**document.metadata, "title": document.title}
    if document.format is not None:
        metadata["format"] = document.format
    return LCDocument(page_content=document.text, metadata=metadata, id=document.id)


def _declared_format(value: Any) -> str | None:
    """A ``format`` from metadata when it names a structure ragsnap parses (a loader's
    ``"pdf"`` or ``"html_page"`` is not a declaration: the text is then detected)."""
    return value if isinstance(value, str) and value in DOCUMENT_FORMATS else None


def from_langchain_documents(
    documents: Sequence[LCDocument | Document | dict[str, Any]],
) -> list[Document]:
    """Documents of any of the usual shapes as ragsnap documents with unique ids.

    The id is the document's ``id``, else ``metadata["id"]``, else its position (``"1"``,
    ``"2"``...); a repeated id gets ``~2``, ``~3``... so citations stay unambiguous. The
    same input always gives the same ids.
    """
    out: list[Document] = []
    seen: set[str] = set()
    for i, item in enumerate(documents):
        if isinstance(item, Document):
            doc = item
        elif isinstance(item, LCDocument):
            metadata = dict(item.metadata or {})
            doc_id = item.id or metadata.get("id") or str(i + 1)
            title = str(metadata.get("title", ""))
            doc = Document(
                id=str(doc_id),
                text=item.page_content,
                title=title,
                metadata=metadata,
                format=_declared_format(metadata.get("format")),
            )
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            doc = Document(
                id=str(item.get("id") or i + 1),
                text=item["text"],
                title=str(item.get("title", "")),
                format=_declared_format(item.get("format")),
            )
        else:
            raise InputError(
                f"documents[{i}]: expected a LangChain Document, a ragsnap Document or "
                "a {'id', 'title', 'text'} dict",
                field=f"documents[{i}]",
            )
        unique, n = doc.id, 1
        while unique in seen:
            n += 1
            unique = f"{doc.id}~{n}"
        if unique != doc.id:
            doc = Document(
                id=unique, text=doc.text, title=doc.title, metadata=doc.metadata, format=doc.format
            )
        seen.add(unique)
        out.append(doc)
    return out


class RagSnapRetriever(BaseRetriever):
    """BM25 over a corpus folder (``.txt``/``.md``/``.jsonl``), as a LangChain retriever.

    Returns up to ``k`` passages (set at construction, or per call:
    ``retriever.invoke(query, k=2)``) with ``id`` (``<file>#<n>``), ``metadata["title"]``,
    ``["source"]``, ``["chunk"]`` and ``["score"]``. ``top_k`` is accepted for ``k``.

    >>> retriever = RagSnapRetriever.from_directory("docs/", k=3)  # doctest: +SKIP
    >>> retriever.invoke("what causes tides?")  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    index: BM25Index
    k: int = Field(default=4, ge=1, validation_alias=AliasChoices("k", "top_k"))

    @classmethod
    def from_directory(
        cls,
        root: str | Path,
        k: int = 4,
        max_words: int = DEFAULT_MAX_WORDS,
        *,
        top_k: int | None = None,
    ) -> RagSnapRetriever:
        """Index the ``.txt``/``.md``/``.jsonl`` files under ``root`` (``top_k``: old name of ``k``)."""
        return cls(index=BM25Index.from_directory(root, max_words), k=top_k or k)

    def _search(self, query: str, k: int | None) -> list[LCDocument]:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InputError("k must be a positive integer", field="k")
        found = self.index.retrieve(query, k if k is not None else self.k)
        return [to_langchain_document(d) for d in found]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[LCDocument]:
        return self._search(query, k)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
    ) -> list[LCDocument]:
        # BM25 over an in-memory index takes milliseconds: no thread hop needed
        return self._search(query, k)
