"""What a citation is: a cited document, its quoted evidence and how it was found."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Quote:
    """A supporting sentence of a document: ``text == document.text[start:end]``.

    ``kept_share`` is the share of the quote's prompt tokens the press kept (mean over
    layers and KV heads; None when no compression ran); ``score`` its evidence in [0, 1].
    """

    text: str
    start: int
    end: int
    score: float
    kept_share: float | None = None


@dataclass(frozen=True)
class Span:
    """A claim of the answer no quote backs: ``text == answer[start:end]``."""

    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Citation:
    """A cited document. ``kept_share`` is the share of its tokens the press kept
    (mean over layers and KV heads), None when no compression ran.

    ``source`` says how it was found: ``"marker"`` (the model wrote ``[n]``),
    ``"attribution"`` (evidence alone) or ``"marker+attribution"``; ``supported`` is
    whether its quotes back what the sentences it is cited for say (claim-level, issue 43;
    None when no evidence was computed: a model-written marker with ``supported=False`` is
    flagged); ``unsupported`` the claims no quote backs (spans into the answer), when not
    supported; ``spans`` the ``[start, end)`` answer offsets of ``sentences``; ``score``
    is the best evidence score of the document for the answer's sentences; ``sentences`` are the indices of the answer
    sentences it supports; ``quotes`` its supporting sentences, best first.
    """

    index: int
    doc_id: str
    title: str
    kept_share: float | None = None
    score: float | None = None
    source: str = "marker"
    supported: bool | None = None
    sentences: tuple[int, ...] = ()
    quotes: tuple[Quote, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()
    unsupported: tuple[Span, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sentences"] = list(self.sentences)
        out["quotes"] = [asdict(q) for q in self.quotes]
        out["spans"] = [list(span) for span in self.spans]
        out["unsupported"] = [asdict(span) for span in self.unsupported]
        return out
