"""The grounded verdict with the model's likelihood (issue 43): the pass that scores an
answer sentence given its quote against given no document, the prompts it reads, the
logistic rule that combines it with the lexical check, and the engine path.

Tiny random models test the mechanics (shapes, batching, the rule on given features); the
language judgement is tested on the embedded model (``model`` marker)."""

from __future__ import annotations

import math

import pytest
import torch

from ragsnap.citations.lift import (
    LiftRule,
    SupportFeatures,
    key_sentence,
    load_lift_rule,
    sentence_quotes,
    support_features,
)
from ragsnap.citations.model import Citation, Quote, Span
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.verdict import Verdict, judge, with_lift
from ragsnap.compression.layer_budgets import model_fingerprint
from ragsnap.engine.events import DoneEvent
from ragsnap.errors import ConfigError
from ragsnap.prompt.documents import Document
from ragsnap.prompt.support_prompt import MAX_QUOTE_TOKENS, support_prompts
from ragsnap.runtime.likelihood import mean_lift, target_logprobs
from tests.tiny_models import random_prompt, tiny_engine, tiny_model, tiny_tokenizer

# grounded when 10 * share + 10 * lift >= 12 (lift clipped to [-1, 1] nats per token)
RULE = LiftRule(lexical=10.0, answer=0.0, lift=10.0, bias=-12.0, clip=1.0)


def test_target_logprobs_are_the_model_s_own_for_each_row_batched_or_alone():
    model = tiny_model("llama")
    rows = [(random_prompt(9, 1), random_prompt(4, 2)), (random_prompt(3, 3), random_prompt(7, 4))]
    batched = target_logprobs(model, rows)
    assert [t.shape for t in batched] == [torch.Size([4]), torch.Size([7])]
    for (prompt, target), got in zip(rows, batched, strict=True):
        alone = target_logprobs(model, [(prompt, target)])[0]
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + target])).logits[0]
        full = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
        expected = full.gather(1, torch.tensor(target).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (torch.cat(batched) <= 0).all()


def test_mean_lift_is_the_difference_of_the_two_conditions_mean_log_probs():
    model = tiny_model("llama")
    given = [random_prompt(12, 5), random_prompt(6, 6)]
    alone = [random_prompt(4, 7), random_prompt(2, 8)]
    targets = [random_prompt(5, 9), random_prompt(3, 10)]
    lift = mean_lift(model, given, alone, targets)
    assert lift.shape == (2,)
    for i in range(2):
        a = target_logprobs(model, [(given[i], targets[i])])[0].mean()
        b = target_logprobs(model, [(alone[i], targets[i])])[0].mean()
        assert float(lift[i]) == pytest.approx(float(a - b), abs=1e-4)
    assert mean_lift(model, [], [], []).shape == (0,)


def test_bad_rows_get_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="row 0"):
        target_logprobs(model, [([], [3])])
    with pytest.raises(ValueError, match="row 1"):
        target_logprobs(model, [([3], [4]), ([3], [])])
    with pytest.raises(ValueError, match="prompts and targets"):
        mean_lift(model, [[3]], [[3], [4]], [[5]])


def test_the_prompts_differ_only_by_the_quote_and_the_target_has_no_markers():
    tokenizer = tiny_tokenizer()
    prompts = support_prompts(tokenizer, "t5 t6", ["t7 t8 t9"], "t10 t11 [2][3]")
    assert prompts.target == tokenizer("t10 t11", add_special_tokens=False)["input_ids"]
    quote = tokenizer("t7 t8 t9", add_special_tokens=False)["input_ids"]
    assert len(prompts.given) > len(prompts.alone)
    assert all(t in prompts.given for t in quote)
    assert not any(t in prompts.alone for t in quote)
    long = support_prompts(tokenizer, "t5", [" ".join(["t7"] * 500)], "t10")
    assert len(long.given) - len(long.alone) <= MAX_QUOTE_TOKENS
    with pytest.raises(ValueError, match="quote"):
        support_prompts(tokenizer, "t5", ["  "], "t10")
    with pytest.raises(ValueError, match="empty"):
        support_prompts(tokenizer, "t5", ["t7"], "[1]")


def test_the_rule_combines_the_features_as_written():
    grounded = SupportFeatures(share=1.0, key_supported=1.0, lift=0.5)
    assert RULE.probability(grounded) == pytest.approx(1 / (1 + math.exp(-3)))
    assert RULE.probability(SupportFeatures(1.0, 1.0, 0.1)) < 0.5  # -12 + 10 + 1 < 0
    assert RULE.probability(SupportFeatures(1.0, 1.0, 9.0)) == RULE.probability(
        SupportFeatures(1.0, 1.0, 1.0)
    )  # clipped
    # no quote cited for the key sentence (or none): the lowest lift the clip allows
    assert RULE.probability(SupportFeatures(1.0, 1.0, None)) == RULE.probability(
        SupportFeatures(1.0, 1.0, -5.0)
    )
    assert RULE.decided(0.0, 0.0) is False  # -12 + 10 * 1 < 0 whatever the lift
    assert RULE.decided(1.0, 1.0) is None  # the lift decides
    assert LiftRule(1.0, 0.0, 1.0, 5.0).decided(0.0, 0.0) is True
    with pytest.raises(ConfigError):
        LiftRule(1.0, 0.0, float("nan"), 0.0)
    with pytest.raises(ConfigError):
        LiftRule(1.0, 0.0, 1.0, 0.0, clip=0.0)


def test_the_key_sentence_is_the_one_that_says_what_the_question_does_not():
    question = "Which has more titles, Arsenal or Chelsea?"
    assert key_sentence("Arsenal has more titles than Chelsea.", question) is None
    answer = "Arsenal and Chelsea are both clubs. Arsenal has 13 league titles."
    key = key_sentence(answer, question)
    assert key is not None and key.text == "Arsenal has 13 league titles."
    assert answer[key.start : key.end] == key.text


def _citation(span: tuple[int, int], quote: str, title: str = "T") -> Citation:
    return Citation(
        index=1,
        doc_id="d",
        title=title,
        supported=True,
        spans=(span,),
        quotes=(Quote(quote, 0, len(quote), 1.0),),
    )


def test_sentence_quotes_and_features():
    sentence = Sentence("Bell Labs was founded in 1925.", 0, 30)
    cited = [_citation((0, 30), "It was founded in 1925."), _citation((31, 40), "Other.")]
    assert sentence_quotes(sentence, cited) == ["T: It was founded in 1925."]
    features = support_features(0.6, [(31, 40)], sentence, 0.4)
    assert features == SupportFeatures(0.6, 1.0, 0.4)
    assert support_features(0.6, [(0, 30)], sentence, 0.4).key_supported == 0.0
    assert support_features(0.6, [], None, 0.4).lift is None


def _done(answer: str, citations: list[Citation]) -> DoneEvent:
    return DoneEvent(answer=answer, citations=citations, stats=None)  # type: ignore[arg-type]


def test_the_rule_decides_the_verdict_and_abstention_follows_it():
    answer = "Bell Labs was founded in 1925 [1]."
    key = Sentence(answer, 0, len(answer))
    cited = [_citation((0, len(answer)), "Bell Labs was founded in 1925.")]
    options = CitationOptions(unsupported="abstain")
    lexical = judge(_done(answer, cited), options)
    assert lexical.grounded is True
    low = judge(_done(answer, cited), options, (key, 0.05), RULE)
    assert low.grounded is False and low.answer == options.abstain_text
    assert low.model_answer == answer and 0 <= low.grounded_score < 0.5
    high = judge(_done(answer, cited), options, (key, 0.6), RULE)
    assert high.grounded is True and high.answer == answer and high.grounded_score >= 0.5
    flagged = [
        Citation(**{**vars(cited[0]), "supported": False, "unsupported": (Span("1925", 25, 29),)})
    ]
    assert judge(_done(answer, flagged), options, (key, 0.9), RULE).grounded is False
    assert with_lift(Verdict(None, None), key, 0.9, RULE) == Verdict(None, None)


def counted_passes(engine, monkeypatch) -> list[int]:
    """The rows of each likelihood pass ``engine``'s citing runs from now on."""
    calls: list[int] = []
    real = engine.citing.runtime.likelihood_spans

    def counted(given, alone, spans):
        calls.append(len(spans))
        return real(given, alone, spans)

    monkeypatch.setattr(engine.citing.runtime, "likelihood_spans", counted)
    return calls


def test_the_engine_runs_one_pass_only_when_the_lift_decides(monkeypatch):
    engine = tiny_engine("llama", seed=4)
    calls = counted_passes(engine, monkeypatch)
    answer = "t5 t6 t7."
    cited = [_citation((0, len(answer)), "t5 t6 t7 t8.")]
    engine.citing.lift_rule = RULE
    key, lift = engine.citing.key_lift("t9", answer, cited)
    assert key is not None and key.text == answer and lift is not None and calls == [1]
    engine.citing.lift_rule = LiftRule(lexical=0.0, answer=0.0, lift=1.0, bias=-5.0)
    assert engine.citing.key_lift("t9", answer, cited) == (key, 0.0)  # decided: no pass
    assert calls == [1]
    assert engine.citing.key_lift("t9", answer, [])[1] is None  # nothing cited for it
    # the engine's answers carry the rule's verdict (a probability as the score)
    engine.citing.lift_rule = RULE
    docs = [Document(id="a", text="t5 t6 t7 t8. t9 t10.", title="T")]
    done = engine.answer("t5 t6", docs)
    assert done.grounded is None or isinstance(done.grounded, bool)
    assert done.grounded_score is None or 0.0 <= done.grounded_score <= 1.0


def test_a_profile_ships_for_the_embedded_model_and_others_keep_the_lexical_verdict():
    assert load_lift_rule("no-such-model") is None
    assert model_fingerprint(tiny_model("llama").config) != "llama-L30-d576-h9-kv3-v49152"
    rule = load_lift_rule("llama-L30-d576-h9-kv3-v49152")
    assert rule is not None and rule.lift > 0  # a likelier sentence is more grounded


def _lift(engine, question: str, quote: str, sentence: str) -> float:
    return engine.citing.sentence_lift(question, [quote], sentence)


def test_on_the_embedded_model_a_quote_makes_what_it_says_likelier(engine):
    """The issue's constructed cases, judged by the model's likelihood alone."""
    quote = "Bell Telephone Laboratories was founded in 1925 in New York."
    asked = "When was Bell Labs founded?"
    copied = _lift(engine, asked, quote, "Bell Telephone Laboratories was founded in 1925.")
    paraphrase = _lift(engine, asked, quote, "Bell Labs was set up in New York in 1925.")
    wrong = _lift(engine, asked, quote, "Bell Telephone Laboratories was founded in 1947.")
    memory = _lift(
        engine,
        "Who invented the telephone?",
        "Bell Labs was founded as a joint venture of AT&T and Western Electric.",
        "Alexander Graham Bell invented the telephone in 1876.",
    )
    unrelated = _lift(
        engine,
        "What pigment gives skin its colour?",
        "Hemocyanin is a copper-containing protein that carries oxygen in the blood of molluscs.",
        "Melanin gives skin its colour.",
    )
    assert copied > paraphrase > memory
    assert paraphrase > unrelated
    # a wrong number beside the right one is still likelier with its quote: the lexical
    # check refutes it (tests/test_citations_support.py), not the lift
    assert copied > wrong > memory
    assert copied > 0.3 and memory < 0.2 and unrelated < 0.2
