"""Does the answer answer the question (issue 43, session 25): the rescue limited to plain
words, the question's coverage by the cited documents and its likelihood given the
quotes, the rule that reads them, the engine's one pass, and their calibration.

Tiny random models test the mechanics; the language judgement is tested on the embedded
model (``model`` marker). No data file is read."""

from __future__ import annotations

import json

import pytest

from ragsnap.citations.lift import KeyEvidence, LiftRule, SupportFeatures
from ragsnap.citations.model import Citation, Quote, Span
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.relevance import coverage, missing_kinds, plain_missing
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.verdict import judge
from ragsnap.engine.events import DoneEvent
from ragsnap.eval.grounding_calibrate import auc, best_bias, fit, labelled
from ragsnap.eval.grounding_features import citation_from_dict, recorded_documents
from ragsnap.prompt.documents import Document
from ragsnap.prompt.support_prompt import MAX_QUESTION_TOKENS, question_prompts
from ragsnap.runtime.likelihood import mean_lift, span_lifts
from tests.test_likelihood_lift import counted_passes
from tests.tiny_models import tiny_engine, tiny_tokenizer

# grounded when 10 * share + 10 * lift >= 12 (lift clipped to [-1, 1] nats per token)
PLAIN = LiftRule(lexical=10.0, answer=0.0, lift=10.0, bias=-12.0, clip=1.0, plain_only=True)


def _cited(sentence: Sentence, quote: str, missing: tuple[Span, ...] = ()) -> Citation:
    return Citation(
        index=1,
        doc_id="d",
        title="T",
        supported=not missing,
        spans=((sentence.start, sentence.end),),
        quotes=(Quote(quote, 0, len(quote), 1.0),),
        unsupported=missing,
    )


def test_a_missing_number_or_name_is_not_plain_a_missing_word_is():
    answer = "The protein LY294L binds insulin in 24.5% of cells."
    sentence = Sentence(answer, 0, len(answer))
    name = Span("LY294L", 12, 18)
    number = Span("24.5", 36, 40)
    word = Span("binds", 19, 24)
    assert missing_kinds(sentence, [_cited(sentence, "x", (name,))]) == {"entity"}
    assert missing_kinds(sentence, [_cited(sentence, "x", (number,))]) == {"number"}
    assert missing_kinds(sentence, [_cited(sentence, "x", (word,))]) == {"word"}
    assert plain_missing(sentence, [_cited(sentence, "x", (word,))])
    assert not plain_missing(sentence, [_cited(sentence, "x", (word, name))])
    assert plain_missing(sentence, [_cited(sentence, "x")])  # nothing missing
    # no citation cited for it: every claim is missing, its name and number too
    assert not plain_missing(sentence, [])


def test_coverage_is_the_share_of_the_question_s_claims_the_texts_hold():
    question = "Which magazine was started first, Arthur's Magazine or First for Women?"
    gold = "Arthur's Magazine (1844-1846) was an American literary periodical."
    distractor = "Slinzega is a town and comune in the Italian region of Lombardy."
    assert coverage(question, [gold]) > coverage(question, [distractor]) == 0.0
    assert coverage(question, [gold, "First for Women is a woman's magazine started 1989."]) > (
        coverage(question, [gold])
    )
    names = frozenset({"entity", "number"})
    assert coverage(question, [gold], names) == pytest.approx(0.5)  # Arthur, not Women
    assert coverage("Is it so?", [distractor]) == 1.0  # the question names nothing


def test_with_plain_only_the_lift_rescues_plain_words_never_a_number_or_name():
    rescued = SupportFeatures(share=0.5, key_supported=0.0, lift=0.8, plain=1.0)
    invented = SupportFeatures(share=0.5, key_supported=0.0, lift=0.8, plain=0.0)
    assert PLAIN.probability(rescued) > 0.5  # -12 + 5 + 8
    assert PLAIN.probability(invented) < 0.5  # the lift counts as 0 at most
    low = SupportFeatures(share=0.5, key_supported=0.0, lift=-0.8, plain=0.0)
    assert PLAIN.logit(low) == pytest.approx(-12 + 5 - 8)  # it still counts against
    free = LiftRule(10.0, 0.0, 10.0, -12.0, 1.0)
    assert free.probability(invented) > 0.5  # the session-24 rule rescued it
    # no lift can ground a sentence with a missing name: decided, no pass
    assert PLAIN.decided(0.5, 0.0, plain=0.0) is False
    assert PLAIN.decided(0.5, 0.0, plain=1.0) is None
    assert free.decided(0.5, 0.0, plain=0.0) is None


def test_coverage_and_the_question_s_lift_enter_the_rule_as_written():
    rule = LiftRule(0.0, 0.0, 0.0, -1.0, clip=1.0, coverage=2.0, question=3.0)
    features = SupportFeatures(1.0, 1.0, 0.0, 1.0, coverage=0.25, question_lift=0.5)
    assert rule.logit(features) == pytest.approx(-1.0 + 0.5 + 1.5)
    # clipped, and an unmeasured question lift is the lowest the clip allows
    assert rule.logit(SupportFeatures(1.0, 1.0, 0.0, 1.0, 0.25, 9.0)) == pytest.approx(2.5)
    assert rule.logit(SupportFeatures(1.0, 1.0, 0.0, 1.0, 0.25, None)) == pytest.approx(-3.5)
    assert rule.asks_question and not PLAIN.asks_question
    assert rule.decided(1.0, 1.0, 1.0, 0.25) is None  # the question's lift decides
    assert rule.decided(1.0, 1.0, 1.0, 2.0) is True  # -1 + 4 - 3 >= 0 whatever it is


def test_the_question_prompts_differ_only_by_the_quote_and_the_question_is_the_target():
    tokenizer = tiny_tokenizer()
    prompts = question_prompts(tokenizer, "t5 t6", ["t7 t8 t9"])
    quote = tokenizer("t7 t8 t9", add_special_tokens=False)["input_ids"]
    asked = tokenizer("t5 t6", add_special_tokens=False)["input_ids"]
    assert all(t in prompts.given for t in quote) and not any(t in prompts.alone for t in quote)
    assert prompts.given[: len(prompts.alone)] == prompts.alone
    assert all(t in prompts.target for t in asked)
    long = question_prompts(tokenizer, " ".join(["t5"] * 500), ["t7"])
    assert len(long.target) <= MAX_QUESTION_TOKENS
    with pytest.raises(ValueError, match="quote"):
        question_prompts(tokenizer, "t5", [" "])
    with pytest.raises(ValueError, match="question"):
        question_prompts(tokenizer, " ", ["t7"])


def test_the_question_s_lift_read_in_the_sentence_s_rows_is_the_one_of_its_own_prompts():
    engine = tiny_engine("llama", seed=4)
    tokenizer, runtime = engine.citing.tokenizer, engine.citing.runtime
    question, quotes = "t5 t6 t9", ["t7 t8 t9"]
    own = question_prompts(tokenizer, question, quotes)
    expected = mean_lift(runtime.model, [own.given], [own.alone], [own.target])
    sentence_lift, question_lift = engine.citing.lifts(question, quotes, "t10 t11", True)
    assert question_lift == pytest.approx(float(expected[0]), abs=1e-4)
    alone = engine.citing.lifts(question, quotes, "t10 t11", False)
    assert alone[1] is None and alone[0] == pytest.approx(sentence_lift, abs=1e-4)
    with pytest.raises(ValueError, match="same tokens"):
        span_lifts(runtime.model, [1, 2, 3], [1, 4, 5], [((1, 3), (1, 3))])
    with pytest.raises(ValueError, match="outside"):
        span_lifts(runtime.model, [1, 2, 3], [1, 2, 3], [((0, 3), (0, 3))])


def test_the_engine_scores_sentence_and_question_in_one_pass_only_when_they_decide(
    monkeypatch,
):
    engine = tiny_engine("llama", seed=4)
    calls = counted_passes(engine, monkeypatch)
    answer = "t5 t6 t7."
    sentence = Sentence(answer, 0, len(answer))
    cited = [_cited(sentence, "t5 t6 t7 t8.")]
    docs = [Document(id="d", text="t5 t6 t7 t8. t9 t10.", title="T")]
    engine.citing.lift_rule = LiftRule(1.0, 0.0, 1.0, -1.5, 1.0, question=1.0, plain_only=True)
    found = engine.citing.key_evidence("t9 t11", answer, cited, docs)
    assert found.key == sentence and found.plain and calls == [2]  # one pass, two rows
    assert found.lift is not None and found.question_lift is not None
    assert found.coverage == pytest.approx(0.5)  # t9 in the document, t11 nowhere
    # a name is missing and nothing else can lift it over: decided, no pass
    flagged = [_cited(sentence, "t5 t6 t8.", (Span("7", 7, 8),))]  # the tiny words' numbers
    engine.citing.lift_rule = LiftRule(0.0, 0.0, 1.0, -0.5, 1.0, plain_only=True)
    assert not plain_missing(sentence, flagged)
    found = engine.citing.key_evidence("t9", answer, flagged, docs)
    assert found.lift == 0.0 and calls == [2]
    # without the question in the rule, its rows stay out of the pass
    engine.citing.lift_rule = LiftRule(1.0, 0.0, 1.0, -1.5, 1.0)
    found = engine.citing.key_evidence("t9", answer, cited, docs)
    assert calls == [2, 1] and found.question_lift is None


def test_the_verdict_reads_the_evidence():
    answer = "LY294L treats it [1]."
    key = Sentence(answer, 0, len(answer))
    cited = [_cited(key, "A drug treats it.", (Span("LY294L", 0, 6),))]
    done = DoneEvent(answer=answer, citations=cited, stats=None)  # type: ignore[arg-type]
    options = CitationOptions()
    free = LiftRule(10.0, 0.0, 10.0, -5.0, 1.0)
    # its one sentence is not backed by its quote: the lift may ground it as a paraphrase
    # (plain), never as content the quote lacks (issue 53)
    assert judge(done, options, KeyEvidence(key, 0.9, plain=True), free).grounded is True
    assert judge(done, options, KeyEvidence(key, 0.9, plain=False), free).grounded is False
    plain = LiftRule(10.0, 0.0, 10.0, -5.0, 1.0, plain_only=True)
    assert judge(done, options, KeyEvidence(key, 0.9, plain=False), plain).grounded is False
    assert judge(done, options, KeyEvidence(key, 0.9, plain=True), plain).grounded is True


def _row(correct: bool, share: float, lift: float, plain: bool, cov: float) -> dict:
    return {
        "correct": correct,
        "lexical_score": share,
        "key_supported": share == 1.0,
        "lift": lift,
        "plain": plain,
        "coverage": cov,
        "question_lift": None,
    }


def test_calibration_reads_the_new_features_and_meets_both_floors_when_it_can(tmp_path):
    right = [_row(True, 1.0, 0.5, True, 0.8), _row(True, 0.0, 0.6, True, 0.7)]
    copied = [_row(False, 1.0, 0.9, True, 0.1)] * 3  # backed, but about something else
    invented = [_row(False, 0.0, 0.7, False, 0.6)] * 3  # a name the quote lacks
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"answerable": right, "unanswerable": copied + invented}))
    data = labelled([path])
    assert len(data) == 8 and data[0][0].coverage == 0.8 and data[-1][0].plain == 0.0
    assert auc(data, lambda f: f.coverage) == 1.0 and auc(data, lambda f: f.lift) < 0.5
    rule = fit(data, 1.0, 0.9, ("lexical", "answer", "lift", "coverage"), True, unanswerable=0.8)
    assert rule.plain_only and rule.coverage > 0
    assert all((rule.probability(f) >= 0.5) == bool(y) for f, y in data)
    # best_bias: both floors met with the widest margin; else Youden's J
    scored = [(SupportFeatures(0, 0, None), y) for y in (1, 1, 0, 0)]
    bias = best_bias([3.0, 1.0, 2.0, 0.0], scored, right_grounded=0.9, unanswerable=0.4)
    assert bias == pytest.approx(-0.5)  # both positives grounded, one negative not
    # rows written before the features existed read them as neutral
    old = {k: v for k, v in right[0].items() if k not in ("plain", "coverage", "question_lift")}
    path.write_text(json.dumps({"answerable": [old], "unanswerable": []}))
    assert labelled([path])[0][0] == SupportFeatures(1.0, 1.0, 0.5, 1.0, 1.0, None)


def test_recorded_citations_and_documents_come_back_as_written():
    citation = Citation(
        index=2,
        doc_id="b",
        title="B",
        supported=False,
        sentences=(0,),
        quotes=(Quote("q.", 0, 2, 0.5, 1.0),),
        spans=((0, 5),),
        unsupported=(Span("x", 1, 2),),
    )
    assert citation_from_dict(json.loads(json.dumps(citation.to_dict()))) == citation
    docs = recorded_documents({"documents": {"2": {"title": "B", "text": "b."}}})
    assert [d.text for d in docs] == ["", "b."]


@pytest.mark.model
def test_on_the_embedded_model_a_quote_about_the_question_makes_it_likelier(engine):
    """The question's lift: a quote about what is asked against one about something else."""
    question = "Which magazine was started first, Arthur's Magazine or First for Women?"
    about = "Arthur's Magazine (1844-1846) was an American literary periodical published in Philadelphia."
    other = "Slinzega is a town and comune in the Italian region of Lombardy."
    lifts = []
    for quote in (about, other):
        _, asked = engine.citing.lifts(question, [quote], "Arthur's Magazine.", True)
        assert asked is not None
        lifts.append(asked)
    assert lifts[0] > lifts[1]
