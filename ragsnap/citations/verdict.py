"""The answer-level verdict (issue 43): is the answer ``grounded`` in its citations, and
what becomes of an answer that is not (``unsupported``: ``flag`` or ``abstain``).

Whatever decides it (the lexical share, or a calibrated likelihood rule), the verdict
never contradicts its own evidence (issue 53, :func:`consistent`): an answer naming a
number, date or name no document mentions is not grounded, and neither is one none of
whose sentences its quotes support, unless the likelihood shows its key sentence to be
a paraphrase of them (lift at least the rule's ``rescue_lift``; with ``rescue_plain``
only plain words missing); a sentence so rescued leaves ``unsupported``. With the rule's
``question_floor``, quotes that do not make the question likelier to the model (about
something else than what was asked) do not ground the answer either, and with its
``link_check`` (session 29) neither does a name the answer supplies that only documents
unlinked to the question's subject hold (:func:`ragsnap.citations.relevance.unlinked`:
an answer that does not answer).
"""

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


def consistent(
    verdict: Verdict,
    share: float | None,
    evidence: KeyEvidence | None,
    rule: LiftRule | None = None,
) -> Verdict:
    """``verdict`` held to its evidence: not grounded (score 0.0) when ``evidence`` lists
    words of the answer no document mentions, when the question's lift given the key
    sentence's quotes is below the rule's ``question_floor``, when (the rule's
    ``link_check``) the key sentence's names sit only in documents not linked to the
    question's subject (``evidence.unlinked``), or when the lexical
    ``share`` is 0 (no sentence supported; with the rule's ``require_key``: the key
    sentence unsupported) and the key sentence is no paraphrase the lift rescues; a
    rescued key sentence is taken off ``unsupported``."""
    if verdict.grounded is None:
        return verdict
    refused = replace(verdict, grounded=False, score=0.0)
    if evidence is not None and evidence.answer_not_in_documents:
        return refused
    if not verdict.grounded:
        return verdict
    floor = rule.question_floor if rule is not None else None
    asked = evidence.question_lift if evidence is not None else None
    if floor is not None and asked is not None and asked < floor:
        return refused
    if rule is not None and rule.link_check and evidence is not None and evidence.unlinked:
        return refused
    key = evidence.key if evidence is not None else None
    span = (key.start, key.end) if key is not None else None
    unbacked = not share or (rule is not None and rule.require_key and span in verdict.unsupported)
    if not unbacked:
        return verdict
    if rule is None or evidence is None or span not in verdict.unsupported:
        return refused
    if rule.rescue_plain and not evidence.plain:
        return refused
    if evidence.lift is None or evidence.lift < rule.rescue_lift:
        return refused
    return replace(verdict, unsupported=tuple(s for s in verdict.unsupported if s != span))


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
    (:func:`with_lift`); else the lexical verdict stands. Either way it is held to its
    evidence (:func:`consistent`). The evidence's ``not_in_documents`` (the question's
    names no document mentions) and ``answer_not_in_documents`` (the answer's) are
    reported."""
    if options.mode != "attribution":
        return done
    lexical = grounding(done.answer, done.citations, options.support)
    verdict = lexical
    evidence = key_lift if isinstance(key_lift, KeyEvidence) else None
    if rule is not None and key_lift is not None:
        if evidence is None:
            assert isinstance(key_lift, tuple)
            evidence = KeyEvidence(*key_lift)
        verdict = with_lift(verdict, evidence.key, evidence.lift, rule, evidence)
    verdict = consistent(verdict, lexical.score, evidence, rule)
    done = replace(  # type: ignore[type-var]  # a DoneEvent: a dataclass
        done,
        grounded=verdict.grounded,
        grounded_score=verdict.score,
        unsupported_sentences=[list(span) for span in verdict.unsupported],
        not_in_documents=list(evidence.not_in_documents) if evidence else [],
        answer_not_in_documents=list(evidence.answer_not_in_documents) if evidence else [],
    )
    if options.unsupported == "abstain" and verdict.grounded is False:
        done = replace(done, answer=options.abstain_text, model_answer=done.answer)  # type: ignore[type-var]
    return done
