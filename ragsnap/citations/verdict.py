"""The answer-level verdict (issue 43): is the answer ``grounded`` in its citations, and
what becomes of an answer that is not (``unsupported``: ``flag`` or ``abstain``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, TypeVar

from ragsnap.citations.claims import claims
from ragsnap.citations.lift import KeyEvidence, LiftRule, support_features
from ragsnap.citations.model import Citation
from ragsnap.citations.sentences import Sentence, split_sentences
from ragsnap.citations.support import SupportRule

if TYPE_CHECKING:
    from ragsnap.citations.options import CitationOptions


class Judged(Protocol):
    """What a verdict is given: an answer and its checked citations (a ``DoneEvent``)."""

    answer: str
    citations: list[Citation]


Answer = TypeVar("Answer", bound=Judged)


@dataclass(frozen=True)
class Verdict:
    """``score``: the share of the answer's claims in supported sentences (None when the
    answer asserts nothing a document could back); ``grounded``: it reaches the rule's
    ``grounded_share`` (None with the score). Decided again by a likelihood rule
    (:func:`with_lift`), ``score`` is the rule's probability and ``grounded`` whether it
    reaches 0.5; ``unsupported``: the ``[start, end)``
    spans of the answer's sentences that are not supported."""

    grounded: bool | None
    score: float | None
    unsupported: tuple[tuple[int, int], ...] = ()


def grounding(
    answer: str, citations: Sequence[Citation], rule: SupportRule | None = None
) -> Verdict:
    """The verdict of ``answer`` from its checked ``citations``: a sentence is supported
    when a citation is cited for it and none lists an unsupported claim inside it."""
    rule = rule or SupportRule()
    total = backed = 0
    unsupported: list[tuple[int, int]] = []
    for sentence in split_sentences(answer):
        weight = len(claims(sentence.text))
        if not weight:
            continue
        span = (sentence.start, sentence.end)
        mine = [c for c in citations if span in c.spans]
        failed = any(sentence.start <= u.start < sentence.end for c in mine for u in c.unsupported)
        total += weight
        if mine and not failed:
            backed += weight
        else:
            unsupported.append(span)
    if not total:
        return Verdict(None, None)
    score = round(backed / total, 4)
    return Verdict(score >= rule.grounded_share, score, tuple(unsupported))


def with_lift(
    verdict: Verdict,
    key: Sentence | None,
    lift: float | None,
    rule: LiftRule,
    evidence: KeyEvidence | None = None,
) -> Verdict:
    """``verdict`` (the lexical one) decided again by ``rule`` from its share, whether the
    ``key`` sentence is supported and the key sentence's ``lift``, and what ``evidence``
    adds (:mod:`ragsnap.citations.lift`); the score becomes the rule's probability."""
    if verdict.score is None:
        return verdict
    features = support_features(verdict.score, verdict.unsupported, key, lift, evidence)
    probability = rule.probability(features)
    return replace(verdict, grounded=probability >= 0.5, score=round(probability, 4))


def judge(
    done: Answer,
    options: CitationOptions,
    key_lift: KeyEvidence | tuple[Sentence | None, float | None] | None = None,
    rule: LiftRule | None = None,
) -> Answer:
    """``done`` with its verdict; with ``unsupported="abstain"`` an answer that is not
    grounded becomes ``options.abstain_text`` (the model's answer kept in
    ``model_answer``). Model markers alone carry no evidence: no verdict. With a ``rule``
    and the answer's key sentence and its lift (``key_lift``: a pair, or the
    :class:`~ragsnap.citations.lift.KeyEvidence` the engine found), the rule decides
    (:func:`with_lift`); else the lexical verdict stands. The evidence's
    ``not_in_documents`` (the question's names no document mentions) is reported."""
    if options.mode != "attribution":
        return done
    verdict = grounding(done.answer, done.citations, options.support)
    if rule is not None and key_lift is not None:
        if isinstance(key_lift, KeyEvidence):
            verdict = with_lift(verdict, key_lift.key, key_lift.lift, rule, key_lift)
        else:
            verdict = with_lift(verdict, *key_lift, rule)
    missing = list(key_lift.not_in_documents) if isinstance(key_lift, KeyEvidence) else []
    done = replace(  # type: ignore[type-var]  # a DoneEvent: a dataclass
        done,
        grounded=verdict.grounded,
        grounded_score=verdict.score,
        unsupported_sentences=[list(span) for span in verdict.unsupported],
        not_in_documents=missing,
    )
    if options.unsupported == "abstain" and verdict.grounded is False:
        done = replace(done, answer=options.abstain_text, model_answer=done.answer)  # type: ignore[type-var]
    return done
