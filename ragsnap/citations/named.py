"""Do the documents name what the question names (issue 43, session 27)?

A question about something no document mentions cannot be answered from the documents,
however well the answer's quotes back its words: with the one passage about "Slinzega"
missing, a model asked "What Italian region does Slinzega come from?" copies a sentence
about another town's region, quotes it faithfully and supplies a region, the kind asked.
What it cannot do is find "Slinzega" in any document.

:func:`not_in_documents` lists the question's numbers and names
(:mod:`ragsnap.citations.claims`: capitalized words inside the sentence, acronyms,
numbers, dates) that no document of the prompt holds, title or text, after the same
normalization the support check uses (case, plurals, number words); a gloss in
parentheses ("DNaseI hypersensitive sites (DHS)") need not be found. The grounded rule's
``named_gate`` (:class:`ragsnap.citations.lift.LiftRule`) refuses an answer while that
list is not empty, and every route reports the list, so a user sees which of the
question's names the documents never mention.

:func:`answer_not_in_documents` (issue 53) reads the answer the same way: an answer from
the model's own knowledge over documents that never mention it ("Alexander Graham Bell
... in 1876" over essays about startups) names what no document holds. Its terms are
the answer's numbers, dates and names and a capitalized word opening one of its sentences
("Paris is ...") that the question does not use (what the question names is its own
gate's, glosses exempt); plain words are left to the support check, since a paraphrase
may choose them (the words the answer shares with the question, "telephone", are
measured too: questions' verbs, "kept", are rarely in the documents). A name the model garbles from a document's (:func:`garbled`: "Pembrol"
for "pembrolizumab", "BIM338" for "BYM338") is no new content and counts as found, and so
does the last word of an answer that stops mid-sentence (cut by the token limit: "684,3"
for "684,360") when a document word begins with it. Any
other such term in no document makes the answer not grounded
(:func:`ragsnap.citations.verdict.judge`), and every route reports them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ragsnap.citations.claims import Claim, claim_keys, claims
from ragsnap.citations.relevance import HARD_KINDS
from ragsnap.citations.sentences import split_sentences
from ragsnap.prompt.documents import Document

# a parenthesized gloss restates what precedes it ("hypersensitive sites (DHS)")
_GLOSS = re.compile(r"\([^()]*\)")
_EDGES = "\"'“”‘’()[]{}<>,.;:!?"


def _word_at(text: str, start: int, end: int) -> str:
    """The whitespace-delimited word of ``text`` holding ``[start, end)``, without the
    punctuation at its edges ("GADD46" for the claim "46" in "of GADD46?")."""
    for word in re.finditer(r"\S+", text):
        if word.start() <= start < word.end():
            return word.group(0).strip(_EDGES) or text[start:end]
    return text[start:end]


def not_in_documents(question: str, documents: Iterable[Document]) -> list[str]:
    """The words of ``question`` holding a number or name (:mod:`ragsnap.citations.claims`)
    that no title or text of ``documents`` holds, as the question writes them, without
    repeats; empty when the question names none or every one is found. What the question
    puts in parentheses glosses what precedes it (an abbreviation, an alias) and need
    not be found."""
    glosses = [m.span() for m in _GLOSS.finditer(question)]
    asked = [
        c
        for c in claims(question)
        if c.kind in HARD_KINDS and not any(a <= c.start < b for a, b in glosses)
    ]
    if not asked:
        return []
    wanted = {c.key for c in asked}
    held: set[str] = set()
    for document in documents:  # read until every key is found (the usual case)
        held |= (claim_keys(document.title) | claim_keys(document.text)) & wanted
        if held == wanted:
            return []
    out: list[str] = []
    seen: set[str] = set()
    for claim in asked:
        word = _word_at(question, claim.start, claim.end)
        if claim.key not in held and claim.key not in seen and word not in out:
            out.append(word)
        seen.add(claim.key)
    return out


# what a term of the answer is (:func:`answer_terms`): a number, date or name; a
# capitalized word opening a sentence; a word the question also uses (its names are the
# question's gate's, :func:`not_in_documents`, whose glosses need not be found); another
TERM_KINDS = ("name", "opening", "asked", "plain")
# the kinds whose absence from every document makes an answer not grounded (issue 53,
# chosen on held-out rows: docs/grounding.md)
GATED_TERMS = frozenset({"name", "opening"})


def answer_terms(answer: str, question: str = "") -> list[tuple[str, Claim]]:
    """The claims of ``answer`` (offsets into it), each with its term kind
    (:data:`TERM_KINDS`)."""
    asked = claim_keys(question) if question else set()
    out: list[tuple[str, Claim]] = []
    for sentence in split_sentences(answer):
        for i, claim in enumerate(claims(sentence.text, sentence.start)):
            if claim.key in asked:  # the question's: its own gate (glosses exempt)
                out.append(("asked", claim))
            elif claim.kind in HARD_KINDS:
                out.append(("name", claim))
            elif i == 0 and claim.text[:1].isupper():
                out.append(("opening", claim))
            else:
                out.append(("plain", claim))
    return out


# a garbled name: at least this long, same first letter, same digits (issue 53)
_GARBLED_MIN = 6


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by at most one substitution, insertion or deletion."""
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    return a[i + (len(a) == len(b)) :] == b[i + 1 :]


def garbled(word: str, vocabulary: Iterable[str]) -> bool:
    """Whether ``word`` (letters and digits, at least six characters) is a document word of
    ``vocabulary`` (lower case) cut short or one edit away, with the same first letter
    and the same digits: the model garbling a name it read, not naming a new one."""
    w = word.lower()
    digits = [c for c in w if c.isdigit()]
    if len(w) < _GARBLED_MIN or not any(c.isalpha() for c in w):
        return False
    for v in vocabulary:
        if not v or v[0] != w[0] or [c for c in v if c.isdigit()] != digits:
            continue
        if (len(v) > len(w) and v.startswith(w)) or _one_edit(w, v):
            return True
    return False


def document_words(documents: Iterable[Document]) -> set[str]:
    """The whitespace-delimited words of the titles and texts, lower case, without the
    punctuation at their edges."""
    out: set[str] = set()
    for document in documents:
        for text in (document.title, document.text):
            out |= {w.strip(_EDGES).lower() for w in text.split()}
    return out


def missing_terms(
    answer: str, documents: Iterable[Document], question: str = ""
) -> dict[str, list[str]]:
    """Per term kind, the words of ``answer`` holding a term (:func:`answer_terms`) that
    no title or text of ``documents`` holds, as the answer writes them, without repeats
    (a name :func:`garbled` from a document's word is found)."""
    terms = answer_terms(answer, question)
    wanted = {c.key for _, c in terms}
    held: set[str] = set()
    documents = list(documents)
    for document in documents:  # read until every key is found (the usual case)
        if held == wanted:
            break
        held |= (claim_keys(document.title) | claim_keys(document.text)) & wanted
    out: dict[str, list[str]] = {kind: [] for kind in TERM_KINDS}
    vocabulary: set[str] | None = None
    last = unfinished_at(answer)
    for kind, claim in terms:
        word = _word_at(answer, claim.start, claim.end)
        if claim.key in held or word in out[kind]:
            continue
        if kind in ("name", "opening"):  # the words only when a name is missing
            vocabulary = document_words(documents) if vocabulary is None else vocabulary
            if garbled(word, vocabulary) or (claim.end >= last and begins_word(word, vocabulary)):
                continue
        out[kind].append(word)
    return out


def unfinished_at(answer: str) -> int:
    """Where the last word of ``answer`` starts when the answer stops mid-sentence (no
    closing punctuation: the token limit cut it), else past its end."""
    text = answer.rstrip()
    if not text or text[-1] in ".!?\"'”’)]":
        return len(answer) + 1
    return len(text) - len(text.split()[-1])


def begins_word(word: str, vocabulary: Iterable[str]) -> bool:
    """Whether a word of ``vocabulary`` (lower case) begins with ``word``."""
    w = word.lower()
    return any(v.startswith(w) for v in vocabulary)


def answer_not_in_documents(
    answer: str,
    documents: Iterable[Document],
    question: str = "",
    kinds: frozenset[str] = GATED_TERMS,
) -> list[str]:
    """The words of ``answer`` holding a term of ``kinds`` (:func:`answer_terms`: its
    numbers, dates and names, a capitalized word opening a sentence) that no title or
    text of ``documents`` holds, as the answer writes them, without repeats; empty when
    every one is found."""
    found = missing_terms(answer, documents, question)
    out: list[str] = []
    for kind in TERM_KINDS:
        out += [w for w in found[kind] if kind in kinds and w not in out]
    return out
