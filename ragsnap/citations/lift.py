"""The verdict with the model's likelihood (issue 43): the lexical check of every sentence,
plus how much the quotes make the answer's key sentence likelier to the model.

The key sentence is the one that answers: the most claims the question does not itself
make (a sentence that only restates the question's entities answers nothing). Its
*lift* is the mean per-token log-prob of the sentence given only its quotes minus given
no document (same chat template, one short pass per condition;
:func:`ragsnap.runtime.likelihood.mean_lift`). A copy or a paraphrase of the quote is
much likelier with it; an answer from memory, or one naming what the quote does not
hold, is not.

The rule is logistic over the lexical share (the share of the answer's claims in
supported sentences), whether the key sentence is supported, the lift, and (session 25-26)
the question's coverage by the cited documents (:mod:`ragsnap.citations.relevance`), the
question's lift and whether the answer supplies the kind of thing asked
(:mod:`ragsnap.citations.asked`), each weighted per profile;
``grounded`` when the probability reaches 0.5, ``score`` that probability. With the
profile's ``named_gate`` (session 27) an answer to a question naming something no
document mentions (:mod:`ragsnap.citations.named`) is not grounded, probability 0. Its
weights are calibrated per model on held-out items (``ragsnap.eval.grounding_calibrate``)
and ship in ``ragsnap/citations/profiles/<model fingerprint>.json``; a model without one
keeps the lexical verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ragsnap.citations.claims import claim_keys, claims
from ragsnap.citations.model import Citation
from ragsnap.citations.sentences import Sentence, split_sentences
from ragsnap.errors import ConfigError


@dataclass(frozen=True)
class LiftRule:
    """``sigmoid(bias + lexical * share + answer * key_supported + lift * L
    + coverage * coverage + question * Q + kind * K)``: ``L`` the key sentence's lift and
    ``Q`` the question's lift given its quotes, each clipped to ``[-clip, clip]`` nats per
    token first (None: ``-clip``); ``K`` whether the answer supplies the kind of thing
    asked (:mod:`ragsnap.citations.asked`). With ``plain_only`` the lift may not rescue a
    key sentence whose missing claims include a number, date or name: its ``L`` is at
    most 0. With ``kind_lowers_lift`` an answer that does not supply the kind asked gets
    the lowest lifts (``L`` and ``Q`` both ``-clip``). With ``named_gate`` the probability
    is 0 when the documents do not name all the question names (``named`` 0.0).

    The verdict also holds to its evidence (issue 53,
    :func:`ragsnap.citations.verdict.consistent`): when no sentence of the answer is
    supported (with ``require_key``: when its key sentence is not), only a paraphrase
    may be grounded, a key sentence whose lift reaches ``rescue_lift`` and, with
    ``rescue_plain``, whose missing claims are plain words only (else any claim some
    document holds: the answer gate has refused the rest); with ``question_floor`` an answer whose key sentence's quotes
    make the question less likely than that (``Q`` below it: quotes about something
    else, the model's judgement) is not grounded; with ``link_check`` (session 29)
    neither is one whose key sentence's names sit only in documents not linked to the
    question's subject (:func:`ragsnap.citations.relevance.unlinked`)."""

    lexical: float
    answer: float
    lift: float
    bias: float
    clip: float = 3.0
    coverage: float = 0.0
    question: float = 0.0
    plain_only: bool = False
    kind: float = 0.0
    kind_lowers_lift: bool = False
    named_gate: bool = False
    rescue_lift: float = 0.0
    rescue_plain: bool = True
    require_key: bool = False
    question_floor: float | None = None
    link_check: bool = False

    def __post_init__(self) -> None:
        values = [self.lexical, self.answer, self.lift, self.bias, self.coverage]
        values += [self.question, self.kind, self.rescue_lift]
        values += [self.question_floor] if self.question_floor is not None else []
        if not all(math.isfinite(v) for v in (*values, self.clip)) or self.clip <= 0:
            raise ConfigError("a lift rule needs finite weights and a positive clip", field="lift")

    def decided(
        self,
        share: float,
        key_supported: float,
        plain: float = 1.0,
        coverage: float = 1.0,
        kind: float = 1.0,
        named: float = 1.0,
    ) -> bool | None:
        """The decision when no lifts within ``[-clip, clip]`` can change it (the pass is
        then skipped), else None."""
        if self.gated(named):
            return False
        z = self.bias + self.lexical * share + self.answer * key_supported
        z += self.coverage * coverage + self.kind * kind
        lowest = self.kind_lowers_lift and not kind
        low = z - abs(self.question) * self.clip
        high = z + abs(self.question) * self.clip
        if lowest:
            low = high = z - self.question * self.clip
        top = 0.0 if self.plain_only and not plain else self.clip
        if lowest:
            top = -self.clip
        low += min(self.lift * -self.clip, self.lift * top)
        high += max(self.lift * -self.clip, self.lift * top)
        if low >= 0:
            return True
        if high < 0:
            return False
        return None

    def gated(self, named: float) -> bool:
        """Whether the named gate refuses an answer whose documents name ``named`` of
        the question's names (1.0: all)."""
        return self.named_gate and named < 1.0

    def _clipped(self, value: float | None) -> float:
        return max(-self.clip, min(self.clip, -self.clip if value is None else value))

    def logit(self, features: SupportFeatures) -> float:
        """``bias + weights . features`` (a None lift: the lowest the clip allows)."""
        lift = self._clipped(features.lift)
        if self.plain_only and not features.plain:
            lift = min(lift, 0.0)
        question = self._clipped(features.question_lift)
        if self.kind_lowers_lift and not features.kind:
            lift = question = -self.clip
        z = self.bias + self.lexical * features.share + self.answer * features.key_supported
        z += self.coverage * features.coverage + self.kind * features.kind
        return z + self.lift * lift + self.question * question

    def probability(self, features: SupportFeatures) -> float:
        """The probability that the answer is grounded, given its ``features``."""
        if self.gated(features.named):
            return 0.0
        return 1 / (1 + math.exp(-self.logit(features)))

    @property
    def asks_question(self) -> bool:
        """Whether the rule reads the question's lift (its rows join the pass)."""
        return self.question != 0.0 or self.question_floor is not None


@dataclass(frozen=True)
class SupportFeatures:
    """``share``: the lexical score; ``key_supported``: 1.0 when the key sentence is
    supported, else 0.0; ``lift``: its likelihood lift (None: there is no key sentence or
    no quote is cited for it; the rule counts it as the lowest lift); ``plain``: 1.0 when
    what no quote backs in the key sentence is plain words only; ``coverage``: the share
    of the question's claims its cited documents hold
    (:mod:`ragsnap.citations.relevance`); ``question_lift``: how much its quotes make the
    question likelier (None: not measured); ``kind``: 1.0 when the answer supplies the
    kind of thing the question asks for (:mod:`ragsnap.citations.asked`), else 0.0;
    ``named``: 1.0 when the prompt's documents name every number and name of the
    question (:mod:`ragsnap.citations.named`), else 0.0."""

    share: float
    key_supported: float
    lift: float | None
    plain: float = 1.0
    coverage: float = 1.0
    question_lift: float | None = None
    kind: float = 1.0
    named: float = 1.0


@dataclass(frozen=True)
class KeyEvidence:
    """What the engine found about the answer's key sentence: the sentence (None: none),
    its lift and the question's lift given its quotes (None: not measured), whether its
    missing claims are plain words, the question's coverage by its cited documents,
    whether the answer supplies the kind of thing asked, the question's numbers and names
    no document of the prompt mentions, and the answer's (issue 53,
    :func:`ragsnap.citations.named.answer_not_in_documents`), and whether the key
    sentence's names stand apart from the question's subject
    (:func:`ragsnap.citations.relevance.unlinked`; None: not checked)."""

    key: Sentence | None
    lift: float | None
    plain: bool = True
    coverage: float = 1.0
    question_lift: float | None = None
    kind: float = 1.0
    not_in_documents: tuple[str, ...] = ()
    answer_not_in_documents: tuple[str, ...] = ()
    unlinked: bool | None = None


def key_sentence(answer: str, question: str) -> Sentence | None:
    """The sentence of ``answer`` that makes the most claims ``question`` does not (the
    first of equals); None when every sentence only restates the question."""
    asked = claim_keys(question)
    best, most = None, 0
    for sentence in split_sentences(answer):
        new = sum(c.key not in asked for c in claims(sentence.text))
        if new > most:
            best, most = sentence, new
    return best


def sentence_quotes(sentence: Sentence, citations: Sequence[Citation]) -> list[str]:
    """What the citations cited for ``sentence`` quote (each with its document's title),
    without repeats."""
    out: list[str] = []
    for citation in citations:
        if (sentence.start, sentence.end) not in citation.spans:
            continue
        for quote in citation.quotes:
            text = f"{citation.title}: {quote.text}" if citation.title else quote.text
            if text not in out:
                out.append(text)
    return out


def support_features(
    share: float,
    unsupported: Sequence[tuple[int, int]],
    key: Sentence | None,
    lift: float | None,
    evidence: KeyEvidence | None = None,
) -> SupportFeatures:
    """The features of an answer whose lexical verdict gave ``share`` and the
    ``unsupported`` sentence spans, with key sentence ``key`` and its ``lift`` (and, from
    ``evidence``, whether its missing claims are plain, the question's coverage and lift)."""
    supported = key is not None and (key.start, key.end) not in set(unsupported)
    if evidence is None:
        evidence = KeyEvidence(key, lift)
    return SupportFeatures(
        share,
        1.0 if supported else 0.0,
        lift if key is not None else None,
        1.0 if evidence.plain else 0.0,
        evidence.coverage,
        evidence.question_lift if key is not None else None,
        evidence.kind,
        0.0 if evidence.not_in_documents else 1.0,
    )


def _profiles() -> Any:
    return resources.files("ragsnap.citations").joinpath("profiles")


def load_lift_rule(fingerprint: str) -> LiftRule | None:
    """The calibrated rule for the model ``fingerprint``, or None when none ships."""
    entry = _profiles().joinpath(f"{fingerprint}.json")
    if not entry.is_file():
        return None
    data = json.loads(entry.read_text(encoding="utf-8"))
    try:
        return LiftRule(**data["rule"])
    except (KeyError, TypeError) as err:
        raise ConfigError(f"lift profile {fingerprint}.json is malformed: {err}") from err
