"""Citation quality of one answer: the attribution methods and their baselines, side by side.

Every method cites a set of documents; each is scored against the gold documents that made
it into the prompt (precision, recall, set F1). Methods: ``markers`` (what the model wrote),
``bm25_top2`` (the two documents BM25 ranks highest for the question, whatever the answer),
``attention`` and ``overlap`` (one kind of evidence alone, each with its own calibrated
threshold) and ``combined`` (the default :class:`AttributionWeights`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ragsnap.citations import extract_citations
from ragsnap.citations.attribution import (
    AttributionWeights,
    Evidence,
    attribute,
    default_attention_layers,
    select_documents,
)
from ragsnap.citations.cite import answer_evidence
from ragsnap.citations.model import Citation
from ragsnap.eval.metrics import contains_any
from ragsnap.prompt.assembly import PromptLayout
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PrefillResult

# one kind of evidence alone (thresholds calibrated like the combined weights; README)
ATTENTION_ONLY = AttributionWeights(
    overlap=0.0,
    attention=1.0,
    question=0.0,
    threshold=0.35,
    top_k=3,
    max_documents=None,
    anchor=False,
)
OVERLAP_ONLY = AttributionWeights(
    overlap=1.0, attention=0.0, question=0.0, threshold=0.1, top_k=2, max_documents=2, anchor=False
)


def set_scores(cited: Sequence[str], gold: Sequence[str]) -> dict[str, float | None]:
    """Precision (None when nothing is cited), recall and set F1 (None without gold)."""
    c, g = set(cited), set(gold)
    hits = len(c & g)
    if not g:
        return {"precision": hits / len(c) if c else None, "recall": None, "f1": None}
    return {
        "precision": hits / len(c) if c else None,
        "recall": hits / len(g),
        "f1": 2 * hits / (len(c) + len(g)),
    }


def bm25_top(layout: PromptLayout, question: str, k: int = 2) -> list[str]:
    """Ids of the ``k`` documents BM25 ranks highest for ``question``."""
    from ragsnap.retrieval.bm25 import BM25Index

    if not layout.documents:
        return []
    return [d.id for d in BM25Index(layout.documents).retrieve(question, k)]


def quote_scores(
    citations: Sequence[Citation],
    evidence_spans: dict[str, Sequence[Sequence[int]]],
    answers: Sequence[str],
) -> dict[str, float | None]:
    """How well the quotes of ``citations`` match the gold evidence.

    ``cite_quote_snippet_overlap``: the mean share of a quote's characters inside the
    gold evidence spans of its document (BioASQ: the question's snippets; None without
    spans or quotes). ``cite_quote_answer``: the share of quotes that contain a gold
    answer (None without quotes or answers).
    """
    quotes = [(c.doc_id, q) for c in citations for q in c.quotes]
    overlap: float | None = None
    if evidence_spans and quotes:
        shares = []
        for doc_id, quote in quotes:
            covered: set[int] = set()
            for lo, hi in evidence_spans.get(doc_id, ()):
                covered.update(range(max(lo, quote.start), min(hi, quote.end)))
            shares.append(len(covered) / max(quote.end - quote.start, 1))
        overlap = sum(shares) / len(shares)
    answer: float | None = None
    if answers and quotes:
        answer = sum(contains_any(q.text, answers) for _, q in quotes) / len(quotes)
    return {"cite_quote_snippet_overlap": overlap, "cite_quote_answer": answer}


def cited_by(evidence: Evidence, weights: AttributionWeights, layout: PromptLayout) -> list[str]:
    ids: list[str] = []
    for picks in select_documents(evidence, weights):
        ids += [layout.documents[d].id for d, _ in picks if layout.documents[d].id not in ids]
    return ids


def citation_methods(
    runtime: ModelRuntime,
    layout: PromptLayout,
    question: str,
    prefill: PrefillResult,
    tokens: Sequence[int],
    gold: Sequence[str],
    correct: float | None,
    weights: AttributionWeights | None = None,
    *,
    evidence_spans: dict[str, Sequence[Sequence[int]]] | None = None,
    answers: Sequence[str] = (),
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Scores ``cite_<method>_{precision,recall,f1}`` for every method, the quote scores of
    the combined citations (:func:`quote_scores`), the evidence matrices (for offline
    calibration) and the seconds the default attribution took (the attention pass only
    when its weights use attention, as in the engine; ``attention_s`` in the detail)."""
    weights = weights or AttributionWeights()
    answer = runtime.tokenizer.decode(list(tokens), skip_special_tokens=True)
    started = time.perf_counter()
    layers = default_attention_layers(len(runtime.windows))
    attention = runtime.answer_attention(prefill, list(tokens), layers)
    attention_s = time.perf_counter() - started
    doc_sentences, evidence = answer_evidence(
        runtime.tokenizer, layout, tokens, question, attention
    )
    citations = attribute(
        answer,
        layout.documents,
        doc_sentences,
        evidence,
        weights,
        keep_rate=prefill.keep_rate().tolist(),
    )
    seconds = time.perf_counter() - started
    if weights.attention == 0:  # the default needs no attention pass (the engine skips it)
        seconds -= attention_s
    methods = {
        "markers": [c.doc_id for c in extract_citations(answer, layout.documents)],
        "bm25_top2": bm25_top(layout, question),
        "attention": cited_by(evidence, ATTENTION_ONLY, layout),
        "overlap": cited_by(evidence, OVERLAP_ONLY, layout),
        "combined": cited_by(evidence, weights, layout),
    }
    scores: dict[str, Any] = {}
    for name, cited in methods.items():
        for key, value in set_scores(cited, gold).items():
            scores[f"cite_{name}_{key}"] = value
        if correct is not None:
            right = set_scores(cited, gold)["precision"] if correct else None
            scores[f"cite_{name}_precision_right"] = right
    scores.update(quote_scores(citations, evidence_spans or {}, answers))
    detail = {
        "methods": methods,
        "quotes": [
            {"doc_id": c.doc_id, "start": q.start, "end": q.end}
            for c in citations
            for q in c.quotes
        ],
        "evidence": evidence.to_dict(),
        "doc_ids": [d.id for d in layout.documents],
        "attention_s": round(attention_s, 4),
    }
    return scores, detail, seconds
