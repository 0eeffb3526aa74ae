"""What an engine adds to a decoded answer about its documents: the marker constraint
while it decodes, its citations after, and the map of the tokens the press kept."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ragsnap.citations import Citation
from ragsnap.citations.asked import answer_kind
from ragsnap.citations.attribution import default_attention_layers
from ragsnap.citations.cite import cite_answer
from ragsnap.citations.kept import DocumentKeptTokens, document_kept_tokens
from ragsnap.citations.lift import (
    KeyEvidence,
    LiftRule,
    key_sentence,
    load_lift_rule,
    sentence_quotes,
    support_features,
)
from ragsnap.citations.markers import MarkerConstraint, marker_candidates, vocabulary_texts
from ragsnap.citations.named import answer_not_in_documents, not_in_documents
from ragsnap.citations.relevance import answer_coverage, plain_missing, unlinked
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.support import SupportRule
from ragsnap.citations.verdict import grounding, judge
from ragsnap.compression.layer_budgets import model_fingerprint
from ragsnap.engine.events import CitationsEvent, DoneEvent
from ragsnap.engine.prepared import PlannedAnswer, PreparedAnswer
from ragsnap.prompt.documents import Document
from ragsnap.prompt.support_prompt import support_prompts
from ragsnap.runtime.decode import DecodeRow, LogitsProcessor
from ragsnap.runtime.model_runtime import ModelRuntime


class AnswerCiting:
    """Citations of the answers of one runtime (its tokenizer's vocabulary read once)."""

    def __init__(self, runtime: ModelRuntime, tokenizer: Any) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self._vocab_texts: list[str] | None = None
        self._marker_candidates: list[int] = []
        # the calibrated likelihood rule of this model (issue 43); None: lexical verdict
        self.lift_rule: LiftRule | None = load_lift_rule(model_fingerprint(runtime.model.config))

    def logits_processor(self, prepared: PreparedAnswer | PlannedAnswer) -> LogitsProcessor | None:
        """The per-row decode constraint of ``prepared`` (marker control), or None."""
        if not prepared.options.citations.marker_control:
            return None
        if self._vocab_texts is None:
            self._vocab_texts = vocabulary_texts(self.tokenizer)
            self._marker_candidates = marker_candidates(self._vocab_texts)
        count = len(prepared.layout.documents)
        return MarkerConstraint(self._vocab_texts, count, self._marker_candidates)

    def cite(
        self, prepared: PreparedAnswer, tokens: list[int]
    ) -> tuple[list[Citation], str | None, float]:
        """Citations of the answer ``tokens``, the answer with inline markers (when asked
        for) and the seconds attribution took."""
        started = time.perf_counter()
        options = prepared.options.citations
        attention = None  # weights that give attention no say skip its pass (its cost)
        if options.mode != "markers" and prepared.layout.documents and options.weights.attention:
            layers = options.attention_layers or default_attention_layers(len(self.runtime.windows))
            attention = self.runtime.answer_attention(prepared.prefill, tokens, layers)
        citations, marked = cite_answer(
            self.tokenizer,
            prepared.layout,
            tokens,
            prepared.question,
            prepared.prefill.keep_rate(),
            options,
            attention,
        )
        return citations, marked, time.perf_counter() - started

    def final_events(
        self, prepared: PreparedAnswer, row: DecodeRow, ttft_s: float | None, model: str
    ) -> tuple[CitationsEvent, DoneEvent]:
        """The citations event and the final event of the answer ``row`` decoded: its
        statistics, its verdict and, when asked for, abstention (issue 43; the streamed
        tokens stay the model's) and the kept-token map."""
        citations, marked, cite_s = self.cite(prepared, row.tokens)
        answer = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        started = time.perf_counter()
        key_lift = None
        if prepared.options.citations.mode == "attribution":
            support = prepared.options.citations.support
            documents = prepared.layout.documents
            if self.lift_rule is not None:
                key_lift = self.key_evidence(
                    prepared.question, answer, citations, documents, support
                )
            else:  # no rule to decide: what the documents never name is still reported
                missing = tuple(not_in_documents(prepared.question, documents))
                invented = tuple(answer_not_in_documents(answer, documents, prepared.question))
                key_lift = KeyEvidence(
                    None, None, not_in_documents=missing, answer_not_in_documents=invented
                )
        cite_s += time.perf_counter() - started
        done = DoneEvent(
            answer=answer,
            citations=citations,
            stats=prepared.stats(row, ttft_s, cite_s, model, str(self.runtime.device)),
            answer_with_markers=marked,
            kept_tokens=self.kept_map(prepared) if prepared.options.kept_tokens else None,
        )
        done = judge(done, prepared.options.citations, key_lift, self.lift_rule)
        return CitationsEvent(citations=citations, answer_with_markers=marked), done

    def key_lift(
        self,
        question: str,
        answer: str,
        citations: list[Citation],
        support: SupportRule | None = None,
        gate: bool = True,
    ) -> tuple[Sentence | None, float | None]:
        """The answer's key sentence and the lift its quotes give it (see
        :meth:`key_evidence`, without documents)."""
        found = self.key_evidence(question, answer, citations, (), support, gate)
        return found.key, found.lift

    def key_evidence(
        self,
        question: str,
        answer: str,
        citations: list[Citation],
        documents: Sequence[Document] = (),
        support: SupportRule | None = None,
        gate: bool = True,
    ) -> KeyEvidence:
        """The answer's key sentence, whether what no quote backs in it is plain words,
        the question's coverage by the ``documents`` the answer cites (the prompt's order,
        as citations count them; 1.0 without documents), whether the answer supplies the
        kind of thing asked (lexical, :mod:`ragsnap.citations.asked`), the question's
        numbers and names no document holds and the answer's
        (:mod:`ragsnap.citations.named`), whether the key sentence's names stand apart
        from the question's subject (:func:`ragsnap.citations.relevance.unlinked`), and
        the lifts: the key sentence's and, when the
        rule reads it, the question's given its quotes, both rows in one short pass. The
        pass is skipped (lifts 0.0) when the lexical features already decide the verdict
        (``gate``), a rescue of the key sentence included
        (:func:`ragsnap.citations.verdict.consistent`); lifts None without a key sentence
        or a quote cited for it."""
        covered = answer_coverage(question, citations, documents) if documents else 1.0
        missing = tuple(not_in_documents(question, documents))
        # without documents (a lift measured alone) nothing can be found missing
        invented = tuple(answer_not_in_documents(answer, documents, question) if documents else ())
        kind = answer_kind(question, answer, citations)
        found = KeyEvidence(
            None,
            None,
            True,
            covered,
            kind=kind,
            not_in_documents=missing,
            answer_not_in_documents=invented,
        )
        key = key_sentence(answer, question)
        if key is None:
            return found
        quotes = sentence_quotes(key, citations)
        apart = unlinked(question, key.text, documents) if documents else None
        found = replace(found, key=key, plain=plain_missing(key, citations), unlinked=apart)
        if not quotes:
            return found
        rule = self.lift_rule
        if gate and rule is not None:
            lexical = grounding(answer, citations, support)
            if lexical.score is None:
                return found
            known = support_features(lexical.score, lexical.unsupported, key, 0.0, found)
            settled = rule.decided(
                known.share, known.key_supported, known.plain, covered, kind, known.named
            )
            # only a paraphrase may ground an answer no sentence of which is supported
            unbacked = not lexical.score or (rule.require_key and not known.key_supported)
            floor = rule.question_floor is not None
            if invented or (unbacked and rule.rescue_plain and not found.plain):
                settled = False
            if rule.link_check and apart:
                settled = False
            # a floor on the question's lift is read whenever the answer may be grounded
            if settled is False or (settled is True and not unbacked and not floor):
                return replace(found, lift=0.0, question_lift=None if floor else 0.0)
        ask = not gate or (rule is not None and rule.asks_question)
        try:
            lift, asked = self.lifts(question, quotes, key.text, ask)
        except ValueError:  # nothing left to score once markers are removed
            return found
        return replace(found, lift=lift, question_lift=asked)

    def lifts(
        self, question: str, quotes: list[str], sentence: str, ask: bool
    ) -> tuple[float, float | None]:
        """The lift ``quotes`` give ``sentence`` and, when ``ask``, the lift they give
        the question itself (read from the same two rows, which hold it before the
        sentence): one short pass (raises ``ValueError`` without a quote)."""
        prompts = support_prompts(self.tokenizer, question, quotes, sentence)
        given = prompts.given + prompts.target
        alone = prompts.alone + prompts.target
        spans = [((len(prompts.given), len(given)), (len(prompts.alone), len(alone)))]
        at_given, at_alone, size = prompts.question
        if ask and size:
            spans.append(((at_given, at_given + size), (at_alone, at_alone + size)))
        lift = self.runtime.likelihood_spans(given, alone, spans)
        return float(lift[0]), float(lift[1]) if len(spans) > 1 else None

    def sentence_lift(self, question: str, quotes: list[str], sentence: str) -> float:
        """How much likelier ``quotes`` make ``sentence`` (mean log-prob per token, given
        them against given no document; raises ``ValueError`` without a quote)."""
        return self.lifts(question, quotes, sentence, False)[0]

    def kept_map(self, prepared: PreparedAnswer) -> list[DocumentKeptTokens]:
        """Per document, the share of layers and heads that kept each of its tokens."""
        layout, prefill = prepared.layout, prepared.prefill
        rate = prefill.keep_rate() if prefill.kept else torch.ones(layout.num_tokens)
        return document_kept_tokens(self.tokenizer, layout.documents, layout.doc_spans, rate)
