"""Which document tokens the press kept: per document, character spans with their keep share.

What the playground's heat map shades. The prompt holds each document as
``format_document(n, doc)`` (a ``[n] title`` header, then the stripped text); the same
piece tokenized with offsets maps every prompt position of the document back to a
``[start, end)`` character span of ``doc.text`` (the span :class:`~ragsnap.citations.Quote`
offsets use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ragsnap.prompt.assembly import (
    document_text_start,
    encode_user_text_with_offsets,
    format_document,
)
from ragsnap.prompt.documents import Document

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KeptSpan:
    """A token of the document: ``doc.text[start:end]``, and ``share``, the share of
    (compressed layer, KV head) pairs that kept it, in [0, 1]. The byte tokens of one
    character (an emoji split in two) each have a span, overlapping on it."""

    start: int
    end: int
    share: float


@dataclass(frozen=True)
class DocumentKeptTokens:
    """The kept-token map of document ``index`` (1-based, as cited). ``spans`` cover the
    tokens of its text that are in the prompt (a truncated document's tail has none);
    ``kept_share`` is their mean share."""

    index: int
    doc_id: str
    kept_share: float
    spans: tuple[KeptSpan, ...]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spans"] = [asdict(s) for s in self.spans]
        return out


def document_kept_tokens(
    tokenizer: Any,
    documents: Sequence[Document],
    doc_spans: Sequence[tuple[int, int]],
    keep_rate: torch.Tensor,
) -> list[DocumentKeptTokens]:
    """The kept-token map of each document of a prompt.

    Parameters
    ----------
    documents, doc_spans
        The prompt's documents and their ``[start, end)`` prompt token spans
        (:class:`~ragsnap.prompt.assembly.PromptLayout`).
    keep_rate
        ``[L]``: share of (compressed layer, KV head) pairs that kept each prompt
        position (:meth:`~ragsnap.runtime.prefill.PrefillResult.keep_rate`).
    """
    rates = keep_rate.tolist()
    out: list[DocumentKeptTokens] = []
    for index, (doc, (begin, end)) in enumerate(zip(documents, doc_spans, strict=True)):
        piece = format_document(index + 1, doc)
        # the piece holds the header, a newline, then doc.text stripped (lead .. tail)
        first = document_text_start(index + 1, doc)
        lead = len(doc.text) - len(doc.text.lstrip())
        tail = len(doc.text.rstrip())
        _, offsets = encode_user_text_with_offsets(tokenizer, piece)
        spans: list[KeptSpan] = []
        for j, (a, b) in enumerate(offsets[: end - begin]):
            lo, hi = max(a - first + lead, lead), min(b - first + lead, tail)
            if hi <= lo:  # the header, the separator, or past the text
                continue
            share = min(max(float(rates[begin + j]), 0.0), 1.0)
            spans.append(KeptSpan(lo, hi, round(share, 4)))
        mean = sum(s.share for s in spans) / len(spans) if spans else 0.0
        out.append(DocumentKeptTokens(index + 1, doc.id, round(mean, 4), tuple(spans)))
    return out
