"""Where each document sentence sits: character offsets in the document, tokens in the prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragsnap.citations.sentences import Sentence, split_sentences
from ragsnap.prompt.assembly import (
    document_header,
    document_text_start,
    encode_user_text_with_offsets,
    format_document,
)
from ragsnap.prompt.documents import Document


@dataclass(frozen=True)
class DocumentSentence:
    """Sentence ``sentence`` of document ``doc`` (0-based, in prompt order); ``tokens`` is
    its ``[start, end)`` prompt token span (empty when truncation cut it off)."""

    doc: int
    sentence: Sentence
    tokens: tuple[int, int]


def document_sentences(
    tokenizer: Any, documents: Sequence[Document], doc_spans: Sequence[tuple[int, int]]
) -> list[list[DocumentSentence]]:
    """Per document, its sentences that made it into the prompt (title included as one)."""
    out: list[list[DocumentSentence]] = []
    for index, (doc, (start, end)) in enumerate(zip(documents, doc_spans, strict=True)):
        piece = format_document(index + 1, doc)
        header = document_header(index + 1, doc)
        shift = document_text_start(index + 1, doc) - (len(doc.text) - len(doc.text.lstrip()))
        _, offsets = encode_user_text_with_offsets(tokenizer, piece)
        found: list[DocumentSentence] = []
        title = doc.title.strip()
        if title:
            at = header.find(title)
            found.append(
                _place(index, Sentence(title, -1, -1), at, at + len(title), offsets, start, end)
            )
        for sentence in split_sentences(doc.text):
            lo, hi = sentence.start + shift, sentence.end + shift
            placed = _place(index, sentence, lo, hi, offsets, start, end)
            if placed.tokens[1] > placed.tokens[0]:
                found.append(placed)
        out.append(found)
    return out


def _place(
    doc: int,
    sentence: Sentence,
    lo: int,
    hi: int,
    offsets: Sequence[tuple[int, int]],
    start: int,
    end: int,
) -> DocumentSentence:
    hit = [j for j, (s, e) in enumerate(offsets) if s < hi and e > lo]
    if not hit:
        return DocumentSentence(doc, sentence, (start, start))
    return DocumentSentence(
        doc, sentence, (min(start + hit[0], end), min(start + hit[-1] + 1, end))
    )


def span_keep_share(keep_rate: Sequence[float] | None, tokens: tuple[int, int]) -> float | None:
    """Mean keep rate over a token span (None without a keep rate or for an empty span)."""
    lo, hi = tokens
    if keep_rate is None or hi <= lo:
        return None
    return round(float(sum(keep_rate[lo:hi])) / (hi - lo), 4)
