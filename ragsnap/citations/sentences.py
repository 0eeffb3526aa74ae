"""Sentences with character offsets, and the words that carry their content."""

from __future__ import annotations

import re
from dataclasses import dataclass

# a sentence ends at . ! ? (optionally followed by quotes/brackets and markers) then
# whitespace, or at a line break; abbreviations like "e.g." are rare in short answers
_BOUNDARY = re.compile(r"(?<=[.!?])(?:[\"')\]]*)(?:\s*\[\d[\d,\s]*\])*\s+|\n+")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for with from as is are was were be been
    being it its this that these those there here which who whom whose what when where why
    how not no yes do does did done has have had having i you he she we they them his her
    their our your my me us can could would should will shall may might must than then so
    such also into about over under after before between during only other some any each
    all both more most very one answer question document documents according""".split()
)


@dataclass(frozen=True)
class Sentence:
    """``text == source[start:end]`` (surrounding whitespace excluded)."""

    text: str
    start: int
    end: int


def split_sentences(text: str) -> list[Sentence]:
    """The non-empty sentences of ``text`` with their ``[start, end)`` character offsets."""
    out: list[Sentence] = []
    begin = 0
    for match in [*_BOUNDARY.finditer(text), None]:
        stop = match.start() if match is not None else len(text)
        if match is not None:
            # keep trailing markers/quotes with their sentence: cut only at the whitespace
            chunk = match.group(0)
            stop = match.start() + len(chunk.rstrip())
        piece = text[begin:stop]
        lead = len(piece) - len(piece.lstrip())
        piece = piece.strip()
        if piece:
            out.append(Sentence(piece, begin + lead, begin + lead + len(piece)))
        if match is not None:
            begin = match.end()
    return out


def content_words(text: str) -> list[str]:
    """Lowercased words of ``text`` without stopwords or one-letter words (digits stay)."""
    words = (w.lower() for w in _WORD.findall(text))
    return [w for w in words if w not in STOPWORDS and (len(w) > 1 or w.isdigit())]
