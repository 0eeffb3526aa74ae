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
  name is in it);
- (issue 53, session 29) whether the names the answer supplies are *linked* to what the
  question asks about (:func:`unlinked`): held by a document that names the question's
  subject, or by one that such a document names by title (or that names it). With the
  answer's own documents gone, the model copies a name from a document about something
  else, which neither names the subject nor links to a document that does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ragsnap.citations.claims import claim_keys, claims
from ragsnap.citations.model import Citation
from ragsnap.citations.sentences import Sentence
from ragsnap.prompt.documents import Document

HARD_KINDS = frozenset({"number", "entity"})
# a title's trailing qualifier: "The Nanny (season 1)", "Chopper Heavy (beer)"
_QUALIFIER = re.compile(r"\s*\([^()]*\)\s*$")


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


def _title_pattern(title: str) -> re.Pattern[str] | None:
    """``title`` without a trailing parenthesized qualifier ("The Nanny (season 1)": "The
    Nanny"), as a case-insensitive whole-word pattern; None when under 3 characters."""
    bare = _QUALIFIER.sub("", title).strip()
    if len(bare) < 3:
        return None
    return re.compile(rf"(?<!\w){re.escape(bare)}(?!\w)", re.IGNORECASE)


def unlinked(question: str, sentence: str, documents: Sequence[Document]) -> bool | None:
    """Whether the names and numbers ``sentence`` (the answer's key sentence) supplies
    stand apart from what ``question`` asks about, by the prompt's ``documents`` (issue 53,
    session 29: answers that do not answer). The subject's documents are those holding
    one of the question's numbers and names (title or text); the answer's, those holding
    one of the sentence's numbers and names the question does not make. They are linked
    when one document is both, or one names the other by its title ("Oakham Castle"
    naming "Walchelin de Ferriers"; a bridge entity's page named by the subject's page).
    True when none is linked (a copied distractor sentence: its name sits in documents
    about something else), False when one is, None when it cannot be checked: the
    question names nothing, the sentence supplies no number or name, or no document holds
    one side (what no document names is the named gates' to judge)."""
    asked = {c.key for c in claims(question) if c.kind in HARD_KINDS}
    if not asked:
        return None
    said = claim_keys(question)
    supplied = {c.key for c in claims(sentence) if c.kind in HARD_KINDS and c.key not in said}
    if not supplied:
        return None
    keys = [claim_keys(d.title) | claim_keys(d.text) for d in documents]
    subject = [d for d, k in zip(documents, keys, strict=True) if k & asked]
    answer = [d for d, k in zip(documents, keys, strict=True) if k & supplied]
    if not subject or not answer:
        return None
    for doc in answer:
        if any(doc is s for s in subject):
            return False
        mine = _title_pattern(doc.title)
        body = f"{doc.title}\n{doc.text}"
        for other in subject:
            theirs = _title_pattern(other.title)
            if mine is not None and mine.search(f"{other.title}\n{other.text}"):
                return False
            if theirs is not None and theirs.search(body):
                return False
    return True
