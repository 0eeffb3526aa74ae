"""The built-in lexical retriever: BM25 (the ``bm25s`` package) over corpus passages."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ragsnap.errors import InputError
from ragsnap.prompt.documents import Document
from ragsnap.retrieval.corpus import DEFAULT_MAX_WORDS, load_corpus


@dataclass(frozen=True)
class ScoredPassage:
    document: Document
    score: float


class BM25Index:
    """A BM25 index over a fixed list of passages (English stopwords removed).

    Build it once (``BM25Index.from_directory(path)``) and query it from any thread:
    retrieval only reads the index.
    """

    def __init__(self, passages: Sequence[Document]) -> None:
        import bm25s
        from bm25s.tokenization import Tokenizer

        # bm25s sets its logger to DEBUG on import: let the application's level decide
        logging.getLogger("bm25s").setLevel(logging.NOTSET)
        if not passages:
            raise InputError("cannot index an empty corpus", field="corpus")
        self.passages = list(passages)
        self._tokenizer = Tokenizer(stopwords="en")
        texts = [f"{p.title}\n{p.text}" for p in self.passages]
        tokens = self._tokenizer.tokenize(texts, return_as="tuple", show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)

    @classmethod
    def from_directory(cls, root: str | Path, max_words: int = DEFAULT_MAX_WORDS) -> BM25Index:
        return cls(load_corpus(root, max_words))

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, top_k: int = 4) -> list[ScoredPassage]:
        """The ``top_k`` best passages for ``query``, best first; passages sharing no term
        with the query are left out (so the list may be shorter, or empty)."""
        if not query.strip():
            raise InputError("the query is empty", field="query")
        if top_k < 1:
            raise InputError("top_k must be at least 1", field="top_k")
        ids = self._tokenizer.tokenize(
            [query], update_vocab=False, return_as="ids", show_progress=False
        )
        k = min(top_k, len(self.passages))
        found, scores = self._bm25.retrieve(ids, k=k, show_progress=False)
        return [
            ScoredPassage(self.passages[int(i)], float(s))
            for i, s in zip(found[0], scores[0], strict=True)
            if s > 0
        ]

    def retrieve(self, query: str, top_k: int = 4) -> list[Document]:
        """The documents of :meth:`search`, their BM25 score in ``metadata["score"]``."""
        return [
            Document(
                id=hit.document.id,
                text=hit.document.text,
                title=hit.document.title,
                metadata={**hit.document.metadata, "score": round(hit.score, 4)},
            )
            for hit in self.search(query, top_k)
        ]
