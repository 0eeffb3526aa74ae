"""Does the answer supply the kind of thing asked (issue 43, session 26): the question's
form, what the key sentence's quotes back, the rule for choices and pairs, the rule's
``kind`` feature, the engine's evidence and the calibration that reads it.

Constructed cases only; no data file is read and no model is loaded beyond a tiny one."""

from __future__ import annotations

import json

import pytest

from ragsnap.citations.asked import (
    answer_kind,
    asked_kind,
    is_date,
    option_keys,
    options_quoted,
    supplies,
)
from ragsnap.citations.claims import claims
from ragsnap.citations.lift import KeyEvidence, LiftRule, SupportFeatures
from ragsnap.citations.model import Citation, Quote
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.verdict import judge
from ragsnap.engine.events import DoneEvent
from ragsnap.eval.grounding_calibrate import fit, labelled
from ragsnap.eval.grounding_eval import kind_features
from ragsnap.eval.grounding_features import relexical
from ragsnap.prompt.documents import Document
from tests.test_likelihood_lift import counted_passes
from tests.tiny_models import tiny_engine


def _cite(answer: str, *quotes: str, title: str = "T", index: int = 1) -> Citation:
    """A citation of the whole one-sentence ``answer`` quoting ``quotes``."""
    return Citation(
        index=index,
        doc_id=str(index),
        title=title,
        supported=True,
        spans=((0, len(answer)),),
        quotes=tuple(Quote(q, 0, len(q), 1.0) for q in quotes),
    )


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        ("When was the bridge opened?", "date"),
        ("In what year did Gregor Mendel die?", "date"),
        ("Peter Marc Jacobson wrote it with an actress born in which year ?", "date"),
        ("How many families did the pilot enrol?", "number"),
        ("What is the size of the site near Albany?", "number"),
        ("Who is the mother of the king?", "name"),
        ("Tryon Lewis is a lawyer from Odessa, Texas which is located in what county?", "name"),
        ("Where is the team based?", "name"),
        ("Which disease is treated with Risdiplam?", "thing"),
        ("What type of cable is it used for?", "thing"),
        ("How are elephants connected to Gajabrishta?", "open"),
        ("Is the Golden Gate Bridge red?", "yesno"),
    ],
)
def test_the_question_s_form_tells_the_kind_asked(question, kind):
    assert asked_kind(question).kind == kind


def test_choices_and_pairs_name_their_options():
    choice = asked_kind("Which director lived longer, Lowell Sherman or Jonathan Kaplan?")
    assert choice.kind == "choice" and choice.options == ("Lowell Sherman", "Jonathan Kaplan")
    dated = asked_kind("Which year was the more recent engine, the Honda K or Honda H, introduced?")
    assert dated.kind == "date" and dated.options == ("Honda K", "Honda H")
    pair = asked_kind("Are both Superdrag and Collective Soul rock bands?")
    assert pair.kind == "pair" and pair.options == ("Superdrag", "Collective Soul")
    common = asked_kind("What type of profession do Dave Pirner and Les McKeown both have?")
    assert common.kind == "thing" and common.options == ("Dave Pirner", "Les McKeown")
    assert asked_kind("Who founded the company?").options == ()


def test_dates_are_years_decades_months_and_centuries_not_any_number():
    said = {c.text: c for c in claims("In March 1957, the 1970s, the 19th century: 42 cars.")}
    assert is_date(said["March"]) and is_date(said["1957"]) and is_date(said["1970s"])
    assert is_date(said["century"]) and not is_date(said["42"])


def test_a_when_question_answered_without_a_date_is_not_of_the_kind_asked():
    question = "When was the Golden Gate Bridge opened?"
    quote = "The Golden Gate Bridge opened in May 1937 after four years of work."
    assert supplies("date", "The bridge opened in 1937.", [quote], question)
    assert not supplies("date", "The bridge opened to great acclaim.", [quote], question)
    # a date the quote does not hold is not backed
    assert not supplies("date", "The bridge opened in 1952.", [quote], question)
    answer = "The Golden Gate Bridge opened with a parade."
    assert answer_kind(question, answer, [_cite(answer, quote)]) == 0.0
    dated = "The Golden Gate Bridge opened in May 1937."
    assert answer_kind(question, dated, [_cite(dated, quote)]) == 1.0


def test_what_the_question_already_names_supplies_nothing():
    question = "How many moons did Galileo find in 1610?"
    quote = "In 1610 Galileo found four moons of Jupiter."
    assert not supplies("number", "Galileo found moons in 1610.", [quote], question)
    assert supplies("number", "Galileo found four moons.", [quote], question)
    who = "Who wrote the novel Armada?"
    assert not supplies("name", "The novel Armada was written.", ["Armada is a novel."], who)
    assert supplies("name", "Ernest Cline wrote Armada.", ["Armada by Ernest Cline."], who)


def test_a_comparison_answer_quoting_only_one_entity_is_not_supported():
    question = "Which director lived longer, Lowell Sherman or Jonathan Kaplan?"
    answer = "Jonathan Kaplan lived longer than Lowell Sherman."
    one = [_cite(answer, "Jonathan Kaplan (born 1947) is an American film director.")]
    assert answer_kind(question, answer, one) == 0.0
    both = one + [_cite(answer, "Lowell Sherman (1888-1934) was an actor.", index=2)]
    assert answer_kind(question, answer, both) == 1.0
    # both quoted, but the answer picks neither option
    neither = "Both were American film directors."
    assert answer_kind(question, neither, both) == 0.0
    # a document's title names its subject: quoting it counts
    titled = one + [_cite(answer, "He was an actor and director.", title="Lowell Sherman")]
    assert answer_kind(question, answer, titled) == 1.0


def test_a_pair_question_needs_facts_about_both():
    question = "Are Mike Bryan and Ray Ruffels both tennis players?"
    answer = "Yes, Mike Bryan and Ray Ruffels are both tennis players."
    assert answer_kind(question, answer, [_cite(answer, "Mike Bryan is a tennis player.")]) == 0.0
    quotes = ("Mike Bryan is a tennis player.", "Ray Ruffels is a former tennis player.")
    assert answer_kind(question, answer, [_cite(answer, *quotes)]) == 1.0
    assert option_keys("Ray Ruffels") == {"ray", "ruffel"}
    assert options_quoted(["Ray Ruffels"], ["Ruffels won."])  # half of its name is enough
    assert not options_quoted(["Ray Ruffels", "Mike Bryan"], ["Ruffels won."])


def test_an_open_question_and_an_answer_without_a_key_sentence():
    open_question = "How are elephants connected to Gajabrishta?"
    said = "Elephants are connected to Gajabrishta through Sanskrit."
    assert answer_kind(open_question, said, [_cite(said, "Gajabrishta is Sanskrit.")]) == 1.0
    # nothing its quotes back beyond the question's own words
    assert answer_kind(open_question, said, [_cite(said, "Elephants are large.")]) == 0.0
    said = "Yes, the Golden Gate Bridge is red."
    assert answer_kind("Is the Golden Gate Bridge red?", said, []) == 1.0  # a yes is enough
    restated = "The Golden Gate Bridge was opened."  # restates the question: no key sentence
    assert answer_kind("When was the Golden Gate Bridge opened?", restated, []) == 0.0


def test_the_kind_enters_the_rule_as_written_and_can_lower_the_lifts():
    rule = LiftRule(0.0, 0.0, 1.0, -1.0, clip=1.0, question=2.0, kind=3.0)
    right = SupportFeatures(1.0, 1.0, 0.5, question_lift=0.25, kind=1.0)
    wrong = SupportFeatures(1.0, 1.0, 0.5, question_lift=0.25, kind=0.0)
    assert rule.logit(right) == pytest.approx(-1.0 + 0.5 + 0.5 + 3.0)
    assert rule.logit(wrong) == pytest.approx(-1.0 + 0.5 + 0.5)
    lowest = LiftRule(0.0, 0.0, 1.0, -1.0, clip=1.0, question=2.0, kind_lowers_lift=True)
    assert lowest.logit(wrong) == pytest.approx(-1.0 - 1.0 - 2.0)
    assert lowest.logit(right) == pytest.approx(-1.0 + 0.5 + 0.5)
    # with the lifts fixed at their lowest the lexical features decide: no pass
    assert lowest.decided(1.0, 1.0, kind=0.0) is False
    assert lowest.decided(1.0, 1.0, kind=1.0) is None
    assert LiftRule(0.0, 0.0, 1.0, -1.0, 1.0, kind=5.0).decided(0.0, 0.0, kind=1.0) is True
    # old profiles read the kind as weightless
    assert LiftRule(1.0, 1.0, 1.0, 0.0).kind == 0.0


def test_the_verdict_and_the_engine_read_the_kind(monkeypatch):
    answer = "t5 t6 t7."
    key = Sentence(answer, 0, len(answer))
    cited = [_cite(answer, "t5 t6 t7 t8.")]
    done = DoneEvent(answer=answer, citations=cited, stats=None)  # type: ignore[arg-type]
    rule = LiftRule(0.0, 0.0, 0.0, -1.0, 1.0, kind=2.0)
    assert judge(done, CitationOptions(), KeyEvidence(key, 0.0, kind=1.0), rule).grounded
    assert not judge(done, CitationOptions(), KeyEvidence(key, 0.0, kind=0.0), rule).grounded
    engine = tiny_engine("llama", seed=4)
    calls = counted_passes(engine, monkeypatch)
    docs = [Document(id="1", text="t5 t6 t7 t8.", title="T")]
    engine.citing.lift_rule = LiftRule(1.0, 0.0, 1.0, -1.5, 1.0, kind_lowers_lift=True)
    found = engine.citing.key_evidence("When was t5 made?", answer, cited, docs)
    assert found.kind == 0.0 and calls == []  # no date: the lowest lift, decided
    found = engine.citing.key_evidence("Which t9 is it?", answer, cited, docs)
    assert found.kind == 1.0 and calls == [1]


def test_rows_carry_the_kind_and_calibration_reads_it(tmp_path):
    question = "When was the Golden Gate Bridge opened?"
    answer = "The Golden Gate Bridge opened with a parade."
    features = kind_features(question, answer, [_cite(answer, "It opened with a parade.")])
    assert features["kind"] == 0.0 and features["asked"] == "date"
    assert features["kind_any"] is False and features["options_quoted"] is None
    row = {"question": question, "model_answer": answer, "citations": [], "kind": 1.0}
    assert relexical(row)["kind"] == 0.0  # measured again from the words
    base = {"lexical_score": 1.0, "key_supported": True, "lift": 0.5, "coverage": 1.0}
    right = [{**base, "correct": True, "kind": 1.0}] * 3
    wrong = [{**base, "correct": False, "kind": 0.0}] * 3
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"answerable": right, "unanswerable": wrong}))
    data = labelled([path])
    assert [f.kind for f, _ in data] == [1.0] * 3 + [0.0] * 3
    rule = fit(data, 1.0, 0.9, ("lexical", "answer", "lift", "kind"), True, unanswerable=0.8)
    assert rule.kind > 0 and all((rule.probability(f) >= 0.5) == bool(y) for f, y in data)
    del right[0]["kind"]  # rows recorded before the feature existed: the kind asked
    path.write_text(json.dumps({"answerable": right[:1], "unanswerable": []}))
    assert labelled([path])[0][0].kind == 1.0


def test_strict_the_key_sentence_may_not_invent_a_name_beside_a_backed_one():
    question = "Which album is Risingson the first single from?"
    quote = "The album was released on 20 April 1998."
    said = "Risingson is the first single from the album Slo-Lo-Lo, released on 20 April 1998."
    assert supplies("thing", said, [quote], question)
    assert not supplies("thing", said, [quote], question, strict=True)  # Slo-Lo-Lo
    assert answer_kind(question, said, [_cite(said, quote)], strict=True) == 0.0
    backed = "Risingson is the first single from the album Mezzanine, released in April."
    cited = [_cite(backed, "Mezzanine is an album released in April 1998.")]
    assert answer_kind(question, backed, cited, strict=True) == 1.0


def test_a_passing_mention_is_not_a_fact_about_an_option():
    question = "Are both Superdrag and Collective Soul rock bands?"
    answer = "Yes, Superdrag and Collective Soul are both rock bands."
    mention = _cite(answer, "Industry Giants is the fifth album by the band Superdrag.")
    tour = _cite(
        answer, "The tour was by the rock band Collective Soul.", title="Collective Soul Tour"
    )
    assert answer_kind(question, answer, [mention, tour]) == 0.0  # Superdrag only mentioned
    subject = _cite(answer, "Superdrag was an American rock band.", title="Industry", index=3)
    assert answer_kind(question, answer, [mention, tour, subject]) == 1.0  # it opens a quote
    assert option_keys("Honda H") == {"honda"}  # one letter names nothing by itself
