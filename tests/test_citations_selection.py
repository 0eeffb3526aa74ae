"""How evidence scores become citations: the question's BM25 prior, the relative gap, the
anchor and the caps (constructed score matrices, no model)."""

from __future__ import annotations

import pytest

from ragsnap.citations.attribution import AttributionWeights, select_from_scores
from ragsnap.citations.overlap import question_relevance
from ragsnap.errors import ConfigError
from ragsnap.prompt.documents import Document
from tests.citation_rules import overlap_rule

DOCS = [
    Document(id="moon", title="Moon", text="The Moon orbits the Earth. Its gravity pulls the sea."),
    Document(id="tides", title="Tides", text="Tides are caused mostly by the gravity of the Moon."),
    Document(id="bees", title="Bees", text="Honeybees dance to show where the flowers are."),
    Document(id="sea", title="Sea", text="The sea covers most of the Earth. Tides move the sea."),
]


def _cited(scores, weights, question=(), named=()):
    return [[d for d, _ in picks] for picks in select_from_scores(scores, weights, question, named)]


def test_question_relevance_ranks_documents_as_the_bm25_retriever_does():
    pytest.importorskip("bm25s")
    from ragsnap.retrieval.bm25 import BM25Index

    for question in ("What causes tides in the sea?", "Where do honeybees dance?", "Moon"):
        relevance = question_relevance(question, [f"{d.title}\n{d.text}" for d in DOCS])
        assert max(relevance) == 1.0 and min(relevance) >= 0.0
        ranked = sorted(range(len(DOCS)), key=lambda d: -relevance[d])
        hits = BM25Index(DOCS).search(question, len(DOCS))
        assert [DOCS[d].id for d in ranked[: len(hits)]] == [h.document.id for h in hits]
    assert question_relevance("zebra?", [d.text for d in DOCS]) == [0.0] * len(DOCS)


def test_the_relative_gap_cites_a_clear_winner_alone_and_a_close_second_too():
    weights = overlap_rule(threshold=0.2, top_k=3, ratio=0.8)
    assert _cited([[0.9, 0.5, 0.3, 0.0]], weights) == [[0]]
    assert _cited([[0.9, 0.5, 0.85, 0.0]], weights) == [[0, 2]]
    no_gap = overlap_rule(threshold=0.2, top_k=3)
    assert _cited([[0.9, 0.5, 0.3, 0.0]], no_gap) == [[0, 1, 2]]
    # the gap is the answer's: a weak sentence's best is no citation beside a strong one
    assert _cited([[0.9, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]], weights) == [[0], []]
    assert _cited([[0.9, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]], no_gap) == [[0], [1]]


def test_the_anchor_cites_the_questions_best_document_first_and_caps_keep_it():
    scores = [[0.1, 0.0, 0.9, 0.0], [0.0, 0.0, 0.0, 0.7]]
    question = [1.0, 0.3, 0.2, 0.6]
    plain = overlap_rule(threshold=0.5, top_k=1, anchor=False)
    assert _cited(scores, plain, question) == [[2], [3]]
    anchored = overlap_rule(threshold=0.5, top_k=1, anchor=True, max_documents=None)
    assert _cited(scores, anchored, question) == [[0, 2], [3]]
    capped = overlap_rule(threshold=0.5, top_k=1, anchor=True, max_documents=2)
    assert _cited(scores, capped, question) == [[0, 2], []]  # the anchor outranks the 0.7
    # no document shares a word with the question: nothing to anchor on
    assert _cited(scores, anchored, [0.0] * 4) == [[2], [3]]


def test_a_flat_question_prior_anchors_every_document_nearly_as_relevant():
    scores = [[0.0, 0.0, 0.0, 0.0]]
    question = [0.75, 1.0, 0.2, 0.8]
    one = overlap_rule(threshold=0.5, anchor=True, max_documents=None)
    assert _cited(scores, one, question) == [[1]]
    flat = overlap_rule(threshold=0.5, anchor=True, anchor_ratio=0.7, max_documents=None)
    assert _cited(scores, flat, question) == [[1, 3, 0]]  # by relevance; 0.2 < 0.7 x 1.0
    capped = overlap_rule(threshold=0.5, anchor=True, anchor_ratio=0.7, max_documents=2)
    assert _cited(scores, capped, question) == [[1, 3]]


def test_documents_the_question_names_are_the_anchors_when_it_names_any():
    scores = [[0.0, 0.0, 0.9, 0.0]]
    question = [1.0, 0.4, 0.3, 0.5]  # BM25 prefers document 0
    named = [False, True, False, True]
    weights = overlap_rule(threshold=0.5, anchor=True, named_anchors=True, max_documents=None)
    assert _cited(scores, weights, question, named) == [[1, 3, 2]]
    # a question that names no document falls back to the BM25 anchor
    assert _cited(scores, weights, question, [False] * 4) == [[0, 2]]
    plain = overlap_rule(threshold=0.5, anchor=True, max_documents=None)
    assert _cited(scores, plain, question, named) == [[0, 2]]


def test_titles_are_named_as_whole_words_without_their_disambiguation():
    from ragsnap.citations.overlap import titles_named

    question = "Which band formed first, Duran Duran or The Fratellis?"
    titles = ["Duran Duran", "Notorious (Duran Duran song)", "The Fratellis", "Duran", "Fra"]
    # "Duran" is found only inside "Duran Duran": the longer name wins
    assert titles_named(question, titles) == [True, False, True, False, False]
    assert titles_named("Is Duran a name? Ask Duran Duran.", titles) == [
        True,
        False,
        False,
        True,
        False,
    ]
    fish = ["Curve (magazine)", "Tropical fish", "Tropical Fish Hobbyist"]
    assert titles_named("Do Tropical Fish Hobbyist and Curve cover one topic?", fish) == [
        True,
        False,
        True,
    ]
    # a name several titles share names none of them
    films = ["The Lone Ranger (1956 film)", "The Lone Ranger (2013 film)", "The Jungle Book"]
    assert titles_named("Which has more animals, The Jungle Book or The Lone Ranger?", films) == [
        False,
        False,
        True,
    ]
    assert titles_named("Is 1802 a year?", ["1802", "a", "Year (calendar)"]) == [
        False,  # digits only
        False,  # too short
        True,
    ]
    assert titles_named("What is C++ used for?", ["C++", "C"]) == [True, False]


@pytest.mark.parametrize(
    "bad",
    [
        {"ratio": 1.5},
        {"anchor_ratio": 1.2},
        {"anchor_ratio": -0.1},
        {"threshold": -0.1},
        {"overlap": float("nan")},
        {"top_k": 0},
        {"max_documents": 0},
    ],
)
def test_unusable_weights_are_refused_with_a_clear_error(bad):
    with pytest.raises(ConfigError):
        AttributionWeights(**bad)


def test_quote_scores_measure_snippet_overlap_and_answer_containment():
    from ragsnap.citations.model import Citation, Quote
    from ragsnap.eval.citation_eval import quote_scores

    text = "Tides are caused mostly by the gravity of the Moon. The sea is salty."
    inside = Quote(text=text[:51], start=0, end=51, score=1.0, kept_share=1.0)
    outside = Quote(text=text[52:], start=52, end=len(text), score=0.5, kept_share=1.0)
    citation = Citation(
        index=1,
        doc_id="tides",
        title="Tides",
        kept_share=1.0,
        score=0.9,
        source="attribution",
        supported=True,
        sentences=(0,),
        quotes=(inside, outside),
    )
    spans = {"tides": [[0, 51]], "other": [[0, 10]]}
    out = quote_scores([citation], spans, ["gravity of the Moon"])
    assert out["cite_quote_snippet_overlap"] == 0.5  # one quote inside, one outside
    assert out["cite_quote_answer"] == 0.5
    half = quote_scores([citation], {"tides": [[26, 51]]}, [])
    assert round(half["cite_quote_snippet_overlap"], 4) == round(25 / 51 / 2, 4)
    assert half["cite_quote_answer"] is None
    assert quote_scores([], spans, ["x"]) == {
        "cite_quote_snippet_overlap": None,
        "cite_quote_answer": None,
    }


def test_bioasq_items_carry_the_character_spans_of_their_gold_snippets():
    from ragsnap.eval.bioasq import _passages, snippet_spans

    question = {
        "snippets": [
            {"text": "Tides follow the Moon.", "document": "http://x/pubmed/11"},
            {"text": "The Moon pulls water.", "document": "http://x/pubmed/11"},
            {"text": "Bees dance.", "document": "http://x/pubmed/22"},
        ]
    }
    passages = _passages(question)
    spans = snippet_spans(passages, question)
    assert set(spans) == {"11", "22"}
    for pmid, found in spans.items():
        for lo, hi in found:
            assert passages[pmid][lo:hi] in {s["text"] for s in question["snippets"]}
    assert len(spans["11"]) == 2
