"""Post-hoc attribution: which documents support each sentence of an answer.

Two kinds of evidence, per (answer sentence, document):

- overlap: the IDF-weighted share of the sentence's content words (and bigrams) that the
  document's best sentence contains (``citations.overlap``);
- attention: the peak attention the sentence's tokens pay to one of the document's kept
  positions, divided by the best document's peak (so 1 = the most attended document),
  averaged over the layers and heads the runtime recomputed;

plus a question prior (the document's BM25 relevance to the question, as the retriever
computes it) and whether the question names the document by its title. The score is a
weighted sum; a sentence cites the documents that reach ``threshold`` (at most ``top_k``),
the answer those within ``ratio`` of its best score and at most ``max_documents``, and with
``anchor`` the documents the question is about too. The weights and the rule are calibrated
on held-out items
(``ragsnap.eval.citation_calibration``; docs/results.md, "Citation attribution").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.citations.markers import marker_numbers_in
from ragsnap.citations.model import Citation, Quote
from ragsnap.citations.overlap import SentenceIndex, question_relevance, titles_named
from ragsnap.citations.quotes import DocumentSentence, span_keep_share
from ragsnap.citations.sentences import Sentence, content_words, split_sentences
from ragsnap.citations.support import SupportRule, check_citations, check_sentence
from ragsnap.errors import ConfigError
from ragsnap.prompt.documents import Document


@dataclass(frozen=True)
class AttributionWeights:
    """How evidence combines into a citation. The defaults were fitted on 100 + 100 eval
    items (HotpotQA and BioASQ factoid, prompt v3, default press at budget 256, embedded
    model, float32), held to a precision of 0.85 on right answers in each set, and the
    fit cross-validated (``python -m ragsnap.eval.citation_calibration``
    ``fit`` / ``cv``, docs/results.md "Citation attribution").

    Per answer sentence, a document's score is the weighted sum of its evidence; the
    sentence cites the documents that reach ``threshold``, at most ``top_k`` of them. The
    answer keeps those within ``ratio`` times its best score (a relative gap: a clear
    winner is cited alone) and at most ``max_documents`` in all (its best-scoring ones).

    With ``anchor``, the documents the question is about are cited for the first sentence
    whatever their score, on top of those: the question names what the answer is about,
    the answer's evidence finds the rest. They are the document the question is most
    relevant to (BM25) and, with ``anchor_ratio``, every document at least that share as
    relevant (a flat prior: several documents answer the question); with ``named_anchors``,
    the documents the question names by title instead, when it names any."""

    overlap: float = 0.7
    attention: float = 0.0  # no say: the engine skips the attention pass
    question: float = 0.3
    threshold: float = 0.1
    top_k: int = 1
    max_documents: int | None = None  # cap for the whole answer (its best-scoring documents)
    ratio: float = 0.0  # a document is cited only within this share of the answer's best
    anchor: bool = True  # the question's most relevant document is cited for sentence 1
    anchor_ratio: float | None = 0.8  # and those at least this share as relevant
    named_anchors: bool = True  # the documents the question names by title, when any

    def __post_init__(self) -> None:
        values = (self.overlap, self.attention, self.question, self.threshold, self.ratio)
        shares = (self.ratio, 1.0 if self.anchor_ratio is None else self.anchor_ratio)
        if any(not math.isfinite(v) or v < 0 for v in values) or not all(
            0 <= v <= 1 for v in shares
        ):
            raise ConfigError(
                "attribution weights and threshold must be finite and >= 0, "
                "ratio and anchor_ratio in [0, 1]",
                field="citations",
            )
        if self.top_k < 1 or (self.max_documents is not None and self.max_documents < 1):
            raise ConfigError("top_k and max_documents must be at least 1", field="citations")

    def score(self, overlap: float, attention: float | None, question: float) -> float:
        if attention is None:  # no attention evidence: overlap and question share its weight
            rest = self.overlap + self.question
            if rest <= 0:
                return 0.0
            total = self.overlap + self.question + self.attention
            return total * (self.overlap * overlap + self.question * question) / rest
        return self.overlap * overlap + self.attention * attention + self.question * question


@dataclass
class Evidence:
    """The evidence matrices of one answer over ``D`` documents and ``S`` answer sentences.

    ``overlap[s][d]``, ``attention[s][d]`` (None without attention) and ``question[d]`` are
    in [0, 1]; ``named[d]``: the question names document ``d`` by its title;
    ``quote[s][d]`` is the index (into ``doc_sentences[d]``) of the document sentence that
    supports sentence ``s`` best, or -1.
    """

    sentences: list[Sentence]
    overlap: list[list[float]]
    attention: list[list[float]] | None
    question: list[float]
    quote: list[list[int]]
    quote_score: list[list[float]]
    named: list[bool] = field(default_factory=list)
    question_text: str = ""  # the question itself (its claims name the topic, issue 43)

    def scores(self, weights: AttributionWeights) -> list[list[float]]:
        """``[S][D]`` combined scores."""
        return [
            [
                weights.score(
                    self.overlap[s][d],
                    None if self.attention is None else self.attention[s][d],
                    self.question[d],
                )
                for d in range(len(self.question))
            ]
            for s in range(len(self.sentences))
        ]

    def to_dict(self) -> dict[str, Any]:
        """Rounded matrices (what eval stores to calibrate the weights offline)."""
        r = lambda rows: [[round(v, 4) for v in row] for row in rows]  # noqa: E731
        return {
            "overlap": r(self.overlap),
            "attention": None if self.attention is None else r(self.attention),
            "question": [round(v, 4) for v in self.question],
            "named": list(self.named),
        }


def answer_token_ends(tokenizer: Any, tokens: Sequence[int]) -> list[int]:
    """Character offset in the decoded answer where each token's text ends."""
    return [
        len(tokenizer.decode(tokens[: j + 1], skip_special_tokens=True)) for j in range(len(tokens))
    ]


def sentence_attention(
    attention: torch.Tensor,
    token_ends: Sequence[int],
    sentences: Sequence[Sentence],
    doc_spans: Sequence[tuple[int, int]],
) -> tuple[list[list[float]], list[torch.Tensor]]:
    """Relative attention of each sentence on each document, and its per-position mass.

    ``attention`` is ``[n, L]`` (query of token ``j`` on prompt position); a sentence uses
    the queries that produced its tokens (token ``j`` came from query ``j - 1``), summed.
    A document's evidence is its peak: the largest summed mass on one of its positions
    (copying attends sharply to the copied token; a long document's diffuse mass is not
    evidence). Returns ``[S][D]`` peaks divided by the best document's, and per sentence
    the ``[L]`` mass.
    """
    rel: list[list[float]] = []
    masses: list[torch.Tensor] = []
    for sentence in sentences:
        produced = [
            j for j, end in enumerate(token_ends) if sentence.start < end <= sentence.end + 1
        ]
        queries = sorted({max(j - 1, 0) for j in produced}) or [0]
        if attention.shape[0]:
            mass = attention[[q for q in queries if q < attention.shape[0]] or [0]].sum(dim=0)
        else:
            mass = torch.zeros(attention.shape[1])
        peaks = [float(mass[s:e].max()) if e > s else 0.0 for s, e in doc_spans]
        best = max(peaks, default=0.0)
        rel.append([v / best if best > 0 else 0.0 for v in peaks])
        masses.append(mass)
    return rel, masses


def default_attention_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose attention is evidence: the upper-middle of the stack, from half
    to five sixths of the depth (layers 15-24 of 30 on the embedded model; chosen on
    held-out HotpotQA items, README "Citations"). The pass stops after the last one."""
    return tuple(range(num_layers // 2, max(num_layers // 2 + 1, (5 * num_layers) // 6)))


def gather_evidence(
    answer: str,
    question: str,
    documents: Sequence[Document],
    doc_sentences: Sequence[Sequence[DocumentSentence]],
    *,
    attention: torch.Tensor | None = None,
    token_ends: Sequence[int] = (),
    doc_spans: Sequence[tuple[int, int]] = (),
) -> Evidence:
    """Overlap (and, with ``attention`` ``[n, L]``, attention) evidence for ``answer``."""
    sentences = [
        s for s in split_sentences(answer) if content_words(s.text) or attention is not None
    ]
    flat = [ds for doc in doc_sentences for ds in doc]
    index = SentenceIndex([ds.sentence.text for ds in flat])
    owner = [ds.doc for ds in flat]
    attn_rel: list[list[float]] | None = None
    masses: list[torch.Tensor] = []
    if attention is not None:
        attn_rel, masses = sentence_attention(attention, token_ends, sentences, doc_spans)
    overlap, quote, quote_score = [], [], []
    for s, sentence in enumerate(sentences):
        best = [0.0] * len(documents)
        pick, pick_score = [-1] * len(documents), [-1.0] * len(documents)
        for k, ds in enumerate(flat):
            d = owner[k]
            value = index.overlap(sentence.text, k)
            best[d] = max(best[d], value)
            if ds.sentence.start < 0:  # a title supports overlap but is no quote
                continue
            here = value
            if masses:
                lo, hi = ds.tokens
                doc_lo, doc_hi = doc_spans[d]
                doc_mass = float(masses[s][doc_lo:doc_hi].sum())
                here += float(masses[s][lo:hi].sum()) / doc_mass if doc_mass > 0 else 0.0
            local = doc_sentences[d].index(ds)
            if here > pick_score[d]:
                pick[d], pick_score[d] = local, here
        overlap.append(best)
        quote.append(pick)
        quote_score.append(pick_score)
    relevance = question_relevance(question, [f"{d.title}\n{d.text}" for d in documents])
    named = titles_named(question, [d.title for d in documents])
    return Evidence(sentences, overlap, attn_rel, relevance, quote, quote_score, named, question)


def select_documents(
    evidence: Evidence, weights: AttributionWeights
) -> list[list[tuple[int, float]]]:
    """Per answer sentence, the ``(doc, score)`` pairs that reach the threshold, best
    first (at most ``top_k`` per sentence; within ``ratio`` of the answer's best score, and
    ``max_documents`` different ones in all), the anchors first in the first sentence."""
    return select_from_scores(evidence.scores(weights), weights, evidence.question, evidence.named)


def anchor_documents(
    weights: AttributionWeights, question: Sequence[float], named: Sequence[bool] = ()
) -> list[int]:
    """The documents ``weights`` anchor the answer on (``question``: ``[D]`` relevance,
    ``named``: ``[D]`` named by title), the first of them first."""
    if not weights.anchor:
        return []
    if weights.named_anchors and any(named):
        return [d for d, is_named in enumerate(named) if is_named]
    if not question or max(question) <= 0:
        return []
    ranked = sorted(range(len(question)), key=lambda d: -question[d])
    if weights.anchor_ratio is None:
        return ranked[:1]
    floor = weights.anchor_ratio * question[ranked[0]]
    return ranked[:1] + [d for d in ranked[1:] if question[d] >= floor]


def select_from_scores(
    scores: Sequence[Sequence[float]],
    weights: AttributionWeights,
    question: Sequence[float] = (),
    named: Sequence[bool] = (),
) -> list[list[tuple[int, float]]]:
    """:func:`select_documents` on a ``[S][D]`` score matrix (``question`` and ``named``:
    ``[D]``, for the anchors)."""
    out: list[list[tuple[int, float]]] = []
    for row in scores:
        picks = sorted(
            ((d, v) for d, v in enumerate(row) if v >= weights.threshold), key=lambda x: -x[1]
        )
        out.append(picks[: weights.top_k])
    if weights.ratio > 0:
        floor = weights.ratio * max((v for picks in out for _, v in picks), default=0.0)
        out = [[(d, v) for d, v in picks if v >= floor] for picks in out]
    anchors = anchor_documents(weights, question, named) if out else []
    if anchors:
        out[0] = [(a, scores[0][a]) for a in anchors] + [
            (d, v) for d, v in out[0] if d not in anchors
        ]
    if weights.max_documents is not None:
        best: dict[int, float] = {}
        for chosen in out:
            for d, v in chosen:
                best[d] = max(best.get(d, 0.0), v)
        # the anchors first (the first of them always stays), then the best-scoring
        ranked = anchors + sorted((d for d in best if d not in anchors), key=lambda d: -best[d])
        keep = set(ranked[: weights.max_documents])
        out = [[(d, v) for d, v in chosen if d in keep] for chosen in out]
    return out


def attribute(
    answer: str,
    documents: Sequence[Document],
    doc_sentences: Sequence[Sequence[DocumentSentence]],
    evidence: Evidence,
    weights: AttributionWeights,
    *,
    keep_rate: Sequence[float] | None = None,
    doc_keep_shares: Sequence[float] | None = None,
    rule: SupportRule | None = None,
) -> list[Citation]:
    """Citations of ``answer``: documents the evidence selects and those the model marked.

    A model-written marker is kept (``source`` ``marker``, or ``marker+attribution`` when
    the evidence selects it too); numbers outside ``1..len(documents)`` are dropped.
    ``supported`` says whether the evidence selects the document and its quotes back the
    claims of the sentences it is cited for (``ragsnap.citations.support``, ``rule``).
    Ordered by first supported sentence.
    """
    scores = evidence.scores(weights)
    chosen = select_documents(evidence, weights)
    marked: dict[int, list[int]] = {}
    for s, sentence in enumerate(evidence.sentences):
        for number in marker_numbers_in(sentence.text):
            if 1 <= number <= len(documents):
                marked.setdefault(number - 1, []).append(s)
    for number in marker_numbers_in(answer):  # markers outside any kept sentence
        if 1 <= number <= len(documents):
            marked.setdefault(number - 1, [])
    chosen = second_hop(evidence, chosen, marked, scores, doc_sentences, documents, rule)
    order: list[int] = []
    support: dict[int, list[int]] = {}
    for s, picks in enumerate(chosen):
        for d, _ in picks:
            support.setdefault(d, []).append(s)
            if d not in order:
                order.append(d)
    order += [d for d in marked if d not in order]
    citations = []
    used: list[list[int]] = []
    for d in order:
        sents = support.get(d, [])
        used.append(sents or marked.get(d, []))
        best = max((scores[s][d] for s in range(len(scores))), default=0.0)
        quotes = _quotes(
            d, sents or marked.get(d, []), evidence, doc_sentences, documents, keep_rate
        )
        source = "attribution" if d not in marked else ("marker+attribution" if sents else "marker")
        doc = documents[d]
        citations.append(
            Citation(
                index=d + 1,
                doc_id=doc.id,
                title=doc.title,
                kept_share=None if doc_keep_shares is None else round(doc_keep_shares[d], 4),
                score=round(best, 4),
                source=source,
                supported=bool(sents) or best >= weights.threshold,
                sentences=tuple(sents),
                quotes=quotes,
            )
        )
    quoted = [
        [_quote_text(evidence, doc_sentences, documents, s, c.index - 1) for s in mine]
        for c, mine in zip(citations, used, strict=True)
    ]
    return check_citations(
        evidence.sentences, citations, used, quoted, documents, evidence.question_text, rule
    )


def second_hop(
    evidence: Evidence,
    chosen: list[list[tuple[int, float]]],
    marked: dict[int, list[int]],
    scores: Sequence[Sequence[float]],
    doc_sentences: Sequence[Sequence[DocumentSentence]],
    documents: Sequence[Document],
    rule: SupportRule | None = None,
    tries: int = 3,
) -> list[list[tuple[int, float]]]:
    """``chosen`` with, for each sentence its documents' quotes do not back, the first of
    its ``tries`` best-scoring other documents whose quote makes it backed: a sentence may
    combine two documents (multi-hop answers), and the evidence picks one (issue 43)."""
    out = [list(picks) for picks in chosen]
    question = evidence.question_text
    for s, sentence in enumerate(evidence.sentences):
        docs = [d for d, _ in out[s]] + [d for d, sents in marked.items() if s in sents]

        def backed(ds: Sequence[int], s: int = s, sentence: Sentence = sentence) -> bool:
            quotes = [_quote_text(evidence, doc_sentences, documents, s, d) for d in ds]
            quotes += [documents[d].title for d in ds if documents[d].title]
            texts = [documents[d].text for d in ds]
            return check_sentence(sentence, quotes, texts, question, rule).supported

        if backed(docs):
            continue
        others = [d for d in range(len(documents)) if d not in docs and evidence.quote[s][d] >= 0]
        for d in sorted(others, key=lambda d: -scores[s][d])[:tries]:
            if backed([*docs, d]):
                out[s].append((d, scores[s][d]))
                break
    return out


def _quote_text(
    evidence: Evidence,
    doc_sentences: Sequence[Sequence[DocumentSentence]],
    documents: Sequence[Document],
    s: int,
    d: int,
) -> str:
    """The sentence document ``d`` quotes for answer sentence ``s`` ("" for none)."""
    k = evidence.quote[s][d]
    if k < 0:
        return ""
    sentence = doc_sentences[d][k].sentence
    return documents[d].text[sentence.start : sentence.end]


def _quotes(
    d: int,
    sentences: Sequence[int],
    evidence: Evidence,
    doc_sentences: Sequence[Sequence[DocumentSentence]],
    documents: Sequence[Document],
    keep_rate: Sequence[float] | None,
) -> tuple[Quote, ...]:
    """The document sentences that best support ``sentences`` of the answer, best first."""
    picked: dict[int, float] = {}
    for s in sentences:
        k = evidence.quote[s][d]
        if k >= 0:
            picked[k] = max(picked.get(k, 0.0), evidence.quote_score[s][d])
    text = documents[d].text
    out = []
    for k, score in sorted(picked.items(), key=lambda x: -x[1]):
        ds = doc_sentences[d][k]
        start, end = ds.sentence.start, ds.sentence.end
        out.append(
            Quote(
                text=text[start:end],
                start=start,
                end=end,
                score=round(min(score / (2.0 if evidence.attention is not None else 1.0), 1.0), 4),
                kept_share=span_keep_share(keep_rate, ds.tokens),
            )
        )
    return tuple(out)
