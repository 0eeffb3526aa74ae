"""Claim-level support: does a citation's quote back what its answer sentence says
(issue 43)?

The rule, per answer sentence (its claims from :mod:`ragsnap.citations.claims`), against
the quoted sentences of the documents cited for it (and their titles):

- every number and date, and every named entity, must be found in the quotes;
- of its other content words, at least ``min_word_share`` must be found;
- the plain words the question itself uses restate it and need not be found; a number
  or entity the question names (the thing asked about) may be anywhere in a cited
  document instead of its quote.

A sentence no document is cited for is unsupported. A citation is ``supported`` when
every sentence it is cited for is, and its own quotes back at least one of their
claims; ``unsupported`` lists the claims (character spans into the answer) no quote
backs in the sentences that are not supported. The answer's ``grounded_score`` is the
share of its claims in supported sentences; it is ``grounded`` when that share reaches
``grounded_share``
(:func:`ragsnap.citations.verdict.grounding`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ragsnap.citations.claims import Claim, claim_keys, claims
from ragsnap.citations.model import Citation, Span
from ragsnap.citations.sentences import Sentence
from ragsnap.errors import ConfigError
from ragsnap.prompt.documents import Document


@dataclass(frozen=True)
class SupportRule:
    """``min_word_share``: the share of a sentence's plain content words (not numbers or
    entities) the question does not use that its quotes must hold; ``grounded_share``: the share of the answer's claims
    that must sit in supported sentences for the answer to be grounded."""

    min_word_share: float = 0.75
    grounded_share: float = 0.5

    def __post_init__(self) -> None:
        values = (self.min_word_share, self.grounded_share)
        if not all(math.isfinite(v) and 0 <= v <= 1 for v in values):
            raise ConfigError(
                "min_word_share and grounded_share must be in [0, 1]", field="citations"
            )


@dataclass(frozen=True)
class SentenceSupport:
    """The check of one answer sentence: its claims and those no quote backs."""

    sentence: Sentence
    claims: tuple[Claim, ...]
    missing: tuple[Claim, ...]
    supported: bool


def check_sentence(
    sentence: Sentence,
    quotes: Sequence[str],
    context: Sequence[str] = (),
    question: str = "",
    rule: SupportRule | None = None,
) -> SentenceSupport:
    """Check ``sentence`` (offsets into the answer) against ``quotes`` (the quoted
    sentences and titles); ``context`` are the cited documents' whole texts, where a
    number or entity the ``question`` names may be found instead."""
    rule = rule or SupportRule()
    said = tuple(claims(sentence.text, sentence.start))
    quoted = set().union(*(claim_keys(q) for q in quotes)) if quotes else set()
    asked = claim_keys(question) if question else set()
    around: set[str] | None = None
    missing: list[Claim] = []
    for claim in said:
        if claim.key in quoted:
            continue
        if claim.key in asked:
            if claim.kind == "word":  # the question's own words restate it
                continue
            if around is None:
                around = set().union(*(claim_keys(c) for c in context)) if context else set()
            if claim.key in around:
                continue
        missing.append(claim)
    hard = [c for c in missing if c.kind != "word"]
    words = [c for c in said if c.kind == "word" and c.key not in asked]
    lost = sum(c.kind == "word" for c in missing)
    enough = not words or (len(words) - lost) / len(words) >= rule.min_word_share
    supported = bool(quotes) and not hard and enough
    return SentenceSupport(sentence, said, tuple(missing), supported)


def check_citations(
    sentences: Sequence[Sentence],
    citations: Sequence[Citation],
    used: Sequence[Sequence[int]],
    quoted: Sequence[Sequence[str]],
    documents: Sequence[Document],
    question: str = "",
    rule: SupportRule | None = None,
) -> list[Citation]:
    """``citations`` with claim-level ``supported``, their sentences' ``spans`` and
    ``unsupported`` spans.

    ``used[i]``: the indices (into ``sentences``) citation ``i`` is cited for;
    ``quoted[i][j]``: the text its document quotes for sentence ``used[i][j]`` ("" for
    none). A citation already unsupported by its evidence stays unsupported."""
    checks = sentence_checks(sentences, citations, used, quoted, documents, question, rule)
    out = []
    for citation, mine, texts in zip(citations, used, quoted, strict=True):
        own = set().union(*(claim_keys(t) for t in texts)) | claim_keys(citation.title)
        contributes = any(c.key in own for s in mine for c in checks[s].claims)
        backed = bool(mine) and all(checks[s].supported for s in mine) and contributes
        failed = [s for s in mine if not checks[s].supported]
        missing = sorted({c for s in failed for c in checks[s].missing}, key=lambda c: c.start)
        out.append(
            replace(
                citation,
                supported=bool(citation.supported) and backed,
                spans=tuple((sentences[s].start, sentences[s].end) for s in mine),
                unsupported=tuple(Span(c.text, c.start, c.end) for c in missing),
            )
        )
    return out


def sentence_checks(
    sentences: Sequence[Sentence],
    citations: Sequence[Citation],
    used: Sequence[Sequence[int]],
    quoted: Sequence[Sequence[str]],
    documents: Sequence[Document],
    question: str = "",
    rule: SupportRule | None = None,
) -> list[SentenceSupport]:
    """One :class:`SentenceSupport` per sentence, against what every citation cited for
    it quotes for it (a sentence two documents back together is supported)."""
    checks = []
    for s, sentence in enumerate(sentences):
        quotes: list[str] = []
        context: list[str] = []
        for citation, mine, texts in zip(citations, used, quoted, strict=True):
            if s not in mine:
                continue
            doc = documents[citation.index - 1]
            quotes += [t for j, t in zip(mine, texts, strict=True) if j == s and t]
            quotes += [doc.title] if doc.title else []
            context.append(doc.text)
        checks.append(check_sentence(sentence, quotes, context, question, rule))
    return checks
