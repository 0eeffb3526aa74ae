"""Claim-level support (issue 43) on constructed answers: what a sentence asserts must be
in its quotes, and the answer's verdict follows its sentences."""

from __future__ import annotations

import pytest

from ragsnap.citations.attribution import AttributionWeights, attribute, gather_evidence
from ragsnap.citations.claims import claims, stem
from ragsnap.citations.options import ABSTAIN_TEXT, CitationOptions
from ragsnap.citations.quotes import document_sentences
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.support import SupportRule, check_sentence
from ragsnap.citations.verdict import grounding, judge
from ragsnap.engine.events import DoneEvent, TokenEvent
from ragsnap.engine.stopping import StopFilter
from ragsnap.errors import ConfigError
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.documents import Document
from tests.tiny_models import tiny_tokenizer

DOCS = [
    Document(
        id="bell",
        title="Bell Labs",
        text="Bell Labs was founded in 1925 by AT&T and Western Electric. "
        "Its researchers built the first transistor and improved the telephone.",
    ),
    Document(
        id="harbor",
        title="Port Town",
        text="The harbor town has 1,200 residents, and its fishermen sailed from it for "
        "centuries. A lighthouse stands on its pier.",
    ),
    Document(
        id="octopus",
        title="Octopus blood",
        text="Octopus blood carries oxygen with hemocyanin, a copper protein that turns blue.",
    ),
]


def _cite(answer: str, question: str, weights: AttributionWeights | None = None, docs=DOCS):
    tokenizer = tiny_tokenizer()
    layout = assemble_prompt(tokenizer, question, docs, max_prompt_tokens=2000)
    doc_sentences = document_sentences(tokenizer, layout.documents, layout.doc_spans)
    evidence = gather_evidence(answer, question, layout.documents, doc_sentences)
    citations = attribute(
        answer, layout.documents, doc_sentences, evidence, weights or AttributionWeights()
    )
    return citations, grounding(answer, citations)


def test_an_answer_from_memory_citing_an_unrelated_sentence_is_not_supported():
    answer = "Alexander Graham Bell invented the telephone."
    citations, verdict = _cite(answer, "Who invented the telephone?")
    assert citations and citations[0].doc_id == "bell"  # the evidence still picks Bell Labs
    assert all(c.supported is False for c in citations)
    missing = {u.text for c in citations for u in c.unsupported}
    assert {"Alexander", "Graham"} <= missing
    for c in citations:
        for u in c.unsupported:
            assert answer[u.start : u.end] == u.text
    assert verdict.grounded is False and verdict.score == 0.0
    assert verdict.unsupported == ((0, len(answer)),)


def test_an_answer_copying_a_document_sentence_is_supported():
    answer = "Bell Labs was founded in 1925 by AT&T and Western Electric."
    citations, verdict = _cite(answer, "When was Bell Labs founded?")
    by_id = {c.doc_id: c for c in citations}
    assert by_id["bell"].supported is True and by_id["bell"].unsupported == ()
    assert by_id["bell"].spans == ((0, len(answer)),)
    assert verdict.grounded is True and verdict.score == 1.0 and verdict.unsupported == ()


def test_a_wrong_number_beside_a_quote_holding_the_right_number_is_not_supported():
    answer = "Bell Labs was founded in 1947 by AT&T and Western Electric."
    citations, verdict = _cite(answer, "When was Bell Labs founded?")
    bell = next(c for c in citations if c.doc_id == "bell")
    assert "1925" in bell.quotes[0].text  # the quote holds the right year
    assert bell.supported is False
    assert [(u.text, answer[u.start : u.end]) for u in bell.unsupported] == [("1947", "1947")]
    assert verdict.grounded is False


def test_a_right_answer_paraphrasing_its_quote_is_supported():
    # case, inflections ("sailed"/"sail") and "1,200" vs "1200"
    answer = "The Harbor Town has 1200 residents whose fishermen sail from it."
    citations, verdict = _cite(answer, "How many people live in the harbor town?")
    harbor = next(c for c in citations if c.doc_id == "harbor")
    assert harbor.supported is True, harbor.unsupported
    assert verdict.grounded is True and verdict.score == 1.0


def test_a_sentence_that_combines_two_documents_cites_both_and_is_supported():
    transistor = Document(
        id="transistor",
        title="Transistor",
        text="The first transistor was demonstrated by John Bardeen and Walter Brattain.",
    )
    answer = "John Bardeen demonstrated it at Bell Labs, founded in 1925."
    question = "Where was the first transistor demonstrated, and when was that place founded?"
    citations, verdict = _cite(answer, question, docs=[*DOCS, transistor])
    by_id = {c.doc_id: c for c in citations}
    assert {"bell", "transistor"} <= set(by_id)
    assert by_id["bell"].supported is True and by_id["transistor"].supported is True
    assert verdict.grounded is True and verdict.score == 1.0
    # a wrong year stays unsupported whatever the second document holds
    wrong, verdict = _cite(answer.replace("1925", "1931"), question, docs=[*DOCS, transistor])
    assert verdict.grounded is False
    assert "1931" in {u.text for c in wrong for u in c.unsupported}


def test_a_word_the_quote_does_not_hold_is_reported_with_its_span():
    answer = "Octopus blood is blue because of melanin."
    citations, verdict = _cite(answer, "Why is octopus blood blue?")
    octopus = next(c for c in citations if c.doc_id == "octopus")
    assert octopus.supported is False
    assert [u.text for u in octopus.unsupported] == ["melanin"]
    assert octopus.to_dict()["unsupported"] == [
        {"text": "melanin", "start": answer.index("melanin"), "end": len(answer) - 1}
    ]
    assert verdict.grounded is False


def test_the_verdict_weighs_sentences_by_what_they_assert():
    answer = "Bell Labs was founded in 1925 by AT&T and Western Electric. It later moved to Paris."
    citations, verdict = _cite(answer, "When was Bell Labs founded?")
    first, second = answer.split(". ")
    assert verdict.unsupported == ((len(first) + 2, len(answer)),)
    asserted_first, asserted_second = len(claims(first)), len(claims(second))
    assert verdict.score == round(asserted_first / (asserted_first + asserted_second), 4)
    assert verdict.grounded is True  # most of what it says is backed (grounded_share 0.5)
    strict = grounding(answer, citations, SupportRule(grounded_share=1.0))
    assert strict.grounded is False and strict.score == verdict.score


def test_claims_normalize_numbers_units_dates_and_inflections():
    keys = [c.key for c in claims("In the 19th century, three towns [2] grew 45% to 1.2 million.")]
    assert keys == ["ord:19", "centuri", "3", "town", "grow", "45", "percent", "1200000"]
    assert [c.key for c in claims("1,200,000 kilometres in Mar 1947")] == [
        "1200000",
        "km",
        "march",
        "1947",
    ]
    assert stem("founded") == stem("founding") == stem("founds") == stem("found")
    assert stem("countries") == stem("country") and stem("stopped") == stem("stop")
    kinds = {c.text: c.kind for c in claims("Yesterday Marie Curie met NASA staff.")}
    assert kinds == {
        "Yesterday": "word",
        "Marie": "entity",
        "Curie": "entity",
        "NASA": "entity",
        "met": "word",
        "staff": "word",
    }


def test_the_question_names_the_topic_the_document_holds_it_anywhere():
    sentence = Sentence("The transistor was built by Bell Labs researchers.", 0, 51)
    quote = ["Its researchers built the first transistor and improved the telephone."]
    # "Bell Labs" is the question's own topic: enough that the cited document holds it
    context = [DOCS[0].text]
    asked = check_sentence(sentence, quote, context, "What did Bell Labs build?")
    assert asked.supported is True
    unasked = check_sentence(sentence, quote, context, "What was built?")
    assert unasked.supported is False and {c.text for c in unasked.missing} == {"Bell", "Labs"}
    assert check_sentence(sentence, [], context, "What did Bell Labs build?").supported is False


def _done(answer: str, citations=()) -> DoneEvent:
    from ragsnap.engine.stats import AnswerStats

    stats = AnswerStats(
        model="m", device="cpu", press="none", press_config={}, budget=None,
        prompt_tokens=1, kept_tokens=1, kept_tokens_per_layer=[], prefill_tokens=1,
        prefill_s=0.0, compress_s=0.0, ttft_s=0.0, decode_ms_per_token=None, new_tokens=1,
        decode_s=0.0, citations_mode="attribution", attribution_s=0.0, kv_bytes_full=0,
        kv_bytes_kept=0, total_s=0.0,
    )  # fmt: skip
    return DoneEvent(answer=answer, citations=list(citations), stats=stats)


def test_abstain_replaces_an_answer_that_is_not_grounded_and_keeps_the_model_answer():
    answer = "Alexander Graham Bell invented the telephone."
    citations, _ = _cite(answer, "Who invented the telephone?")
    flagged = judge(_done(answer, citations), CitationOptions())
    assert flagged.answer == answer and flagged.model_answer is None
    assert flagged.grounded is False and flagged.grounded_score == 0.0
    assert flagged.unsupported_sentences == [[0, len(answer)]]
    abstained = judge(_done(answer, citations), CitationOptions(unsupported="abstain"))
    assert abstained.answer == ABSTAIN_TEXT == "The documents do not answer this."
    assert abstained.model_answer == answer and abstained.grounded is False
    custom = CitationOptions(unsupported="abstain", abstain_text="No idea from these.")
    assert judge(_done(answer, citations), custom).answer == "No idea from these."
    # a grounded answer stays, markers mode has no evidence and so no verdict
    right = "Bell Labs was founded in 1925 by AT&T and Western Electric."
    cites, _ = _cite(right, "When was Bell Labs founded?")
    kept = judge(_done(right, cites), CitationOptions(unsupported="abstain"))
    assert kept.answer == right and kept.grounded is True and kept.model_answer is None
    markers = judge(
        _done(answer, citations), CitationOptions(mode="markers", unsupported="abstain")
    )
    assert markers.answer == answer and markers.grounded is None
    # an answer without documents is not grounded; one that asserts nothing has no verdict
    assert judge(_done(answer), CitationOptions()).grounded is False
    assert judge(_done("Yes."), CitationOptions(unsupported="abstain")).answer == "Yes."
    with pytest.raises(ConfigError, match="unsupported must be one of"):
        CitationOptions(unsupported="hide")


def test_a_stop_string_keeps_the_verdict_and_the_abstention():
    answer = "Alexander Graham Bell invented the telephone. STOP more"
    citations, _ = _cite(answer, "Who invented the telephone?")
    done = judge(_done(answer, citations), CitationOptions(unsupported="abstain"))
    stopper = StopFilter(["STOP"])
    stopper.push(TokenEvent(text=answer))
    [cut] = stopper.push(done)
    assert cut.answer == ABSTAIN_TEXT and cut.grounded is False
    assert cut.model_answer == "Alexander Graham Bell invented the telephone. "
