"""Citations: ``[n]`` markers in an answer mapped back to the documents of the prompt."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ragsnap.documents import Document

# [1], [2, 3], [1-2] is not a citation style we ask for; "[2][3]" is two markers
_MARKER = re.compile(r"\[(\d{1,4}(?:\s*,\s*\d{1,4})*)\]")


@dataclass(frozen=True)
class Citation:
    """A cited document. ``kept_share`` is the share of its tokens the press kept
    (mean over layers and KV heads), None when no compression ran."""

    index: int
    doc_id: str
    title: str
    kept_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cited_indices(answer: str) -> list[int]:
    """Numbers inside ``[n]`` / ``[n, m]`` markers, in order of first appearance, unique."""
    seen: list[int] = []
    for match in _MARKER.finditer(answer):
        for part in match.group(1).split(","):
            number = int(part)
            if number not in seen:
                seen.append(number)
    return seen


def document_keep_shares(keep_rate: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[float]:
    """Mean of ``keep_rate`` (``[L]``, share of layers x heads keeping each position) over each span."""
    return [float(keep_rate[s:e].mean()) if e > s else 0.0 for s, e in spans]


def extract_citations(
    answer: str,
    documents: Sequence[Document],
    keep_shares: Sequence[float] | None = None,
) -> list[Citation]:
    """Citations of ``answer`` against ``documents`` numbered from 1; numbers not given are dropped."""
    citations = []
    for number in cited_indices(answer):
        if 1 <= number <= len(documents):
            doc = documents[number - 1]
            share = None if keep_shares is None else round(keep_shares[number - 1], 4)
            citations.append(
                Citation(index=number, doc_id=doc.id, title=doc.title, kept_share=share)
            )
    return citations
