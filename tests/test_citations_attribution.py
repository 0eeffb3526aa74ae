"""Post-hoc attribution on constructed answers: which documents, which quotes, which markers."""

from __future__ import annotations

from ragsnap.citations.attribution import AttributionWeights, attribute, gather_evidence
from ragsnap.citations.markers import insert_markers, strip_markers
from ragsnap.citations.quotes import document_sentences
from ragsnap.citations.sentences import split_sentences
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.documents import Document
from tests.tiny_models import tiny_tokenizer

DOCS = [
    Document(
        id="tides",
        title="Tides",
        text="Tides rise and fall twice a day. They are caused mostly by the Moon's gravity.",
    ),
    Document(
        id="rosetta",
        title="Rosetta Stone",
        text="  The stone was found in 1799 near Rashid. "
        "It has been kept in the British Museum since 1802. Visitors queue to see it.",
    ),
    Document(
        id="bees",
        title="Honeybees",
        text="Honeybees show where flowers are with a waggle dance.",
    ),
]
OVERLAP = AttributionWeights(
    overlap=1.0,
    attention=0.0,
    question=0.0,
    threshold=0.5,
    top_k=3,
    max_documents=None,
    anchor=False,
)


def _cite(answer: str, question: str = "Where is the Rosetta Stone kept?", weights=OVERLAP):
    tokenizer = tiny_tokenizer()
    layout = assemble_prompt(tokenizer, question, DOCS, max_prompt_tokens=2000)
    doc_sentences = document_sentences(tokenizer, layout.documents, layout.doc_spans)
    evidence = gather_evidence(answer, question, layout.documents, doc_sentences)
    return attribute(answer, layout.documents, doc_sentences, evidence, weights), evidence


def test_answer_copied_from_document_2_cites_it_with_the_quote_offsets():
    citations, _ = _cite("It has been kept in the British Museum since 1802.")
    assert [c.index for c in citations] == [2]
    [citation] = citations
    assert citation.doc_id == "rosetta" and citation.source == "attribution"
    assert citation.supported is True and citation.sentences == (0,)
    quote = citation.quotes[0]
    text = DOCS[1].text
    assert quote.text == "It has been kept in the British Museum since 1802."
    assert text[quote.start : quote.end] == quote.text
    assert quote.start == text.index("It has been")
    assert citation.to_dict()["quotes"][0]["start"] == quote.start


def test_with_the_default_weights_a_copied_answer_cites_its_document():
    answer = "It has been kept in the British Museum since 1802."
    citations, evidence = _cite(answer, weights=AttributionWeights())
    assert evidence.attention is None  # the defaults need no attention pass
    assert [c.doc_id for c in citations] == ["rosetta"]
    quote = citations[0].quotes[0]
    assert DOCS[1].text[quote.start : quote.end] == quote.text == answer
    # the question is about tides: its anchor is cited first, and the document the answer
    # was copied from is cited too (the overlap dominates the calibrated weights)
    citations, _ = _cite(answer, question="What causes the tides?", weights=AttributionWeights())
    assert [c.doc_id for c in citations] == ["tides", "rosetta"]
    # without the anchor, only the copied document
    no_anchor = AttributionWeights(anchor=False)
    citations, _ = _cite(answer, question="What causes the tides?", weights=no_anchor)
    assert [c.doc_id for c in citations] == ["rosetta"]


def test_a_document_the_answer_does_not_use_is_not_cited():
    citations, evidence = _cite(
        "The stone was found in 1799 near Rashid. Tides are caused mostly by the Moon's gravity."
    )
    assert {c.doc_id for c in citations} == {"rosetta", "tides"}
    assert "bees" not in {c.doc_id for c in citations}
    assert len(evidence.sentences) == 2
    by_id = {c.doc_id: c for c in citations}
    assert by_id["rosetta"].sentences == (0,) and by_id["tides"].sentences == (1,)


def test_model_markers_are_kept_checked_and_out_of_range_numbers_dropped():
    citations, _ = _cite("It has been kept in the British Museum since 1802 [2][3][9].")
    by_index = {c.index: c for c in citations}
    assert set(by_index) == {2, 3}  # [9]: no ninth document
    assert by_index[2].source == "marker+attribution" and by_index[2].supported is True
    assert by_index[3].source == "marker" and by_index[3].supported is False  # flagged


def test_sentences_keep_their_offsets_and_trailing_markers():
    text = "Paris is big [1]. It has a tower. [2]\nYes."
    sentences = split_sentences(text)
    assert [s.text for s in sentences] == ["Paris is big [1].", "It has a tower. [2]", "Yes."]
    assert all(text[s.start : s.end] == s.text for s in sentences)


def test_inline_markers_go_after_each_supported_sentence_and_strip_back_to_the_answer():
    answer = "It is kept in London. It was found in 1799 [2]."
    spans = [(s.start, s.end) for s in split_sentences(answer)]
    marked = insert_markers(answer, spans, [[2], [2, 1]])
    assert marked == "It is kept in London [2]. It was found in 1799 [2] [1]."
    assert "[" not in strip_markers(marked)
