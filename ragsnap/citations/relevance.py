"""Does the answer answer the question, beyond being backed by its quotes (issue 43)?

A sentence copied from a document its quote backs perfectly, yet it may answer nothing:
with the answer's documents gone, a model copies a sentence of whatever document is left.
Two cheap signs, read from words alone:

- the *coverage* of the question by the documents the answer cites: the share of the
  question's numbers and names (:mod:`ragsnap.citations.claims`) their titles and texts
  hold (:func:`answer_coverage`, the rule's feature; :func:`coverage` takes any texts and
  kinds, for measuring others). A document about something else holds few of the names
  the question asks about;
- whether the key sentence's *missing* claims (what no quote backs) are plain words only
  or include a number, a date or a name: a likelihood rescue is allowed only for the
  former (a quote's vocabulary makes fluent text likelier whether or not an invented
  name is in it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ragsnap.citations.claims import claim_keys, claims
from ragsnap.citations.model import Citation
from ragsnap.citations.sentences import Sentence
from ragsnap.prompt.documents import Document

HARD_KINDS = frozenset({"number", "entity"})


def missing_kinds(sentence: Sentence, citations: Sequence[Citation]) -> set[str]:
    """The kinds (``number``, ``entity``, ``word``) of the claims of ``sentence`` that
    the checked ``citations`` list as unsupported (offsets into the answer); every claim
    of a sentence no citation is cited for."""
    said = claims(sentence.text, sentence.start)
    mine = [c for c in citations if (sentence.start, sentence.end) in c.spans]
    if not mine:
        return {c.kind for c in said}
    starts = {u.start for c in mine for u in c.unsupported}
    return {c.kind for c in said if c.start in starts}


def plain_missing(sentence: Sentence, citations: Sequence[Citation]) -> bool:
    """Whether what no quote backs in ``sentence`` is plain words only (no number,
    date or name): the only case where the likelihood may rescue it."""
    return not (missing_kinds(sentence, citations) & HARD_KINDS)


def coverage(question: str, texts: Iterable[str], kinds: frozenset[str] | None = None) -> float:
    """The share of the claims of ``question`` (of ``kinds``; all when None) whose keys
    ``texts`` hold; 1.0 when the question makes none."""
    asked = {c.key for c in claims(question) if kinds is None or c.kind in kinds}
    if not asked:
        return 1.0
    held: set[str] = set()
    for text in texts:
        held |= claim_keys(text)
    return len(asked & held) / len(asked)


def cited_documents(sentence: Sentence, citations: Sequence[Citation]) -> list[int]:
    """The (1-based) indices of the documents cited for ``sentence``, without repeats."""
    out: list[int] = []
    for citation in citations:
        if (sentence.start, sentence.end) in citation.spans and citation.index not in out:
            out.append(citation.index)
    return out


def answer_coverage(
    question: str, citations: Sequence[Citation], documents: Sequence[Document]
) -> float:
    """The share of the numbers and names of ``question`` that the documents the answer
    cites hold (titles and texts; ``documents`` in the prompt's order, as citations count
    them); 1.0 when the question names none, 0.0 when nothing is cited."""
    cited = {c.index for c in citations if 0 < c.index <= len(documents)}
    texts = [t for i in sorted(cited) for t in (documents[i - 1].title, documents[i - 1].text)]
    return coverage(question, texts, HARD_KINDS)
