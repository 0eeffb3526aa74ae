"""Citations: model-written ``[n]`` markers, and attribution of answer sentences to the
documents (with quotes) that does not depend on the model writing markers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragsnap.citations.markers import cited_indices
from ragsnap.citations.model import Citation, Quote
from ragsnap.prompt.documents import Document

__all__ = ["Citation", "Quote", "cited_indices", "document_keep_shares", "extract_citations"]


def document_keep_shares(keep_rate: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[float]:
    """Mean of ``keep_rate`` (``[L]``, share of layers x heads keeping each position) over each span."""
    return [float(keep_rate[s:e].mean()) if e > s else 0.0 for s, e in spans]


def extract_citations(
    answer: str,
    documents: Sequence[Document],
    keep_shares: Sequence[float] | None = None,
) -> list[Citation]:
    """Citations of ``answer``'s markers against ``documents`` numbered from 1; numbers
    not given are dropped (no evidence is computed: ``supported`` stays None)."""
    citations = []
    for number in cited_indices(answer):
        if 1 <= number <= len(documents):
            doc = documents[number - 1]
            share = None if keep_shares is None else round(keep_shares[number - 1], 4)
            citations.append(
                Citation(index=number, doc_id=doc.id, title=doc.title, kept_share=share)
            )
    return citations
