"""The named gate (issue 43, session 27): an answer to a question that names what no
document mentions is not grounded, and every route says which names the documents lack.

Constructed cases on a tiny random model; no data file is read."""

from __future__ import annotations

import json

import pytest

from ragsnap.citations.lift import KeyEvidence, LiftRule, SupportFeatures
from ragsnap.citations.model import Citation, Quote
from ragsnap.citations.named import not_in_documents
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.verdict import judge
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import DoneEvent
from ragsnap.eval.grounding_calibrate import best_bias, fit, labelled
from ragsnap.eval.grounding_eval import prompt_documents
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.local_client import LocalClient
from tests.test_likelihood_lift import counted_passes
from tests.tiny_models import tiny_engine

POLICORO = Document(
    id="policoro",
    title="Policoro",
    text='Policoro is a town and "comune" in the Italian region of Basilicata.',
)
SLINZEGA = Document(
    id="slinzega", title="Slinzega", text="Slinzega is a cured meat from Valtellina, Lombardy."
)
QUESTION = "What Italian region does Slinzega come from?"
GATE = LiftRule(0.0, 0.0, 0.0, 5.0, 1.0, named_gate=True)  # grounded unless gated


def test_the_names_no_document_mentions_are_listed_as_the_question_writes_them():
    assert not_in_documents(QUESTION, [POLICORO]) == ["Slinzega"]
    assert not_in_documents(QUESTION, [POLICORO, SLINZEGA]) == []
    # numbers and dates count; case, plurals and number words are normalized
    question = "How many Olympic Games did Norway host between 1952 and 1994?"
    docs = [Document(id="1", text="NORWAY hosted the olympic games twice: in 1952 and 1994.")]
    assert not_in_documents(question, docs) == []
    assert not_in_documents(question, [Document(id="1", text="Norway, 1952.")]) == [
        "Olympic",
        "Games",
        "1994",
    ]
    # a title counts; a name repeated is listed once, as the word that holds it
    assert not_in_documents("Is Basilicata bigger than Basilicata's neighbours?", []) == [
        "Basilicata"
    ]
    question = "Does FTO-guided demethylation of GADD46 drive myogenesis in KEYNOTE-522?"
    docs = [Document(id="1", text="FTO demethylates GADD45 mRNA.")]
    assert not_in_documents(question, docs) == ["GADD46", "KEYNOTE-522"]
    # a gloss in parentheses restates what precedes it: not required
    question = "How many DNaseI hypersensitive sites (DHS) mark the beta globin locus?"
    docs = [Document(id="1", text="Five DNaseI hypersensitive sites (HSs) mark it.")]
    assert not_in_documents(question, docs) == []
    # plain words are not names
    assert not_in_documents("what is the region of the town?", [POLICORO]) == []
    assert (
        not_in_documents("Where is Policoro?", [Document(id="p", text="", title="Policoro")]) == []
    )


def test_the_gate_refuses_whatever_the_other_features_say_and_old_profiles_lack_it():
    backed = SupportFeatures(1.0, 1.0, 1.0, coverage=1.0, kind=1.0)
    assert GATE.probability(backed) > 0.99
    unnamed = SupportFeatures(1.0, 1.0, 1.0, coverage=1.0, kind=1.0, named=0.0)
    assert GATE.probability(unnamed) == 0.0
    assert GATE.decided(1.0, 1.0, named=0.0) is False  # no pass needed
    assert GATE.decided(1.0, 1.0, named=1.0) is True
    ungated = LiftRule(0.0, 0.0, 0.0, 5.0, 1.0)
    assert ungated.probability(unnamed) > 0.99 and not ungated.named_gate


def test_the_verdict_reports_the_missing_names_and_the_engine_skips_the_pass(monkeypatch):
    answer = "Slinzega comes from the Italian region of Basilicata."
    cited = [
        Citation(
            index=1,
            doc_id="policoro",
            title="Policoro",
            supported=True,
            spans=((0, len(answer)),),
            quotes=(Quote(POLICORO.text, 0, len(POLICORO.text), 1.0),),
        )
    ]
    done = DoneEvent(answer=answer, citations=cited, stats=None)  # type: ignore[arg-type]
    key = Sentence(answer, 0, len(answer))
    judged = judge(done, CitationOptions(), KeyEvidence(key, 0.5, not_in_documents=("X",)), GATE)
    assert judged.grounded is False and judged.grounded_score == 0.0
    assert judged.not_in_documents == ["X"]
    abstained = judge(
        done,
        CitationOptions(unsupported="abstain"),
        KeyEvidence(key, 0.5, not_in_documents=("X",)),
        GATE,
    )
    assert abstained.model_answer == answer and abstained.answer != answer
    assert judge(done, CitationOptions(), KeyEvidence(key, 0.5), GATE).grounded is True
    engine = tiny_engine("llama", seed=4)
    calls = counted_passes(engine, monkeypatch)
    engine.citing.lift_rule = LiftRule(0.0, 0.0, 1.0, 0.0, 1.0, named_gate=True)
    found = engine.citing.key_evidence(QUESTION, answer, cited, [POLICORO])
    assert found.not_in_documents == ("Slinzega",) and calls == []  # gated: decided
    found = engine.citing.key_evidence(QUESTION, answer, cited, [POLICORO, SLINZEGA])
    assert found.not_in_documents == () and calls == [1]  # the lift decides


def test_every_route_says_what_the_documents_never_mention(tmp_path, capsys, monkeypatch):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from ragsnap.cli import main
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.integrations.langchain import ChatRagSnap
    from ragsnap.integrations.langchain.rag import cited_answer

    engine = tiny_engine("llama", "sdpa", seed=4)
    docs = [{"id": "policoro", "title": "Policoro", "text": POLICORO.text}]
    options = AnswerOptions(generation=GenerationConfig(max_new_tokens=6))
    assert engine.citing.lift_rule is None  # a model without a profile: reported only
    done = list(engine.stream(QUESTION, [POLICORO], options))[-1]
    assert isinstance(done, DoneEvent) and done.not_in_documents == ["Slinzega"]
    engine.citing.lift_rule = GATE
    done = list(engine.stream(QUESTION, [POLICORO], options))[-1]
    assert isinstance(done, DoneEvent) and done.not_in_documents == ["Slinzega"]
    assert done.grounded is False
    chat = ChatRagSnap(engine=engine, max_new_tokens=6)
    reply = chat.invoke(QUESTION, documents=[POLICORO])
    assert reply.response_metadata["not_in_documents"] == ["Slinzega"]
    assert cited_answer(reply)["not_in_documents"] == ["Slinzega"]
    body = {"question": QUESTION, "documents": docs, "max_new_tokens": 6}
    openai = {
        "model": "ragsnap",
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": docs,
        "max_tokens": 6,
    }
    with LocalClient(create_app(Settings(cache_url="none"), engine=engine)) as client:
        native = client.post("/v1/answer", json=body).json()
        chat_json = client.post("/v1/chat/completions", json=openai).json()
        named = client.post(
            "/v1/answer", json={**body, "question": "What region does Policoro lie in?"}
        ).json()
    assert native["not_in_documents"] == ["Slinzega"] and native["grounded"] is False
    assert chat_json["ragsnap"]["not_in_documents"] == ["Slinzega"]
    assert named["not_in_documents"] == []
    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(lambda cls, *a, **k: engine))
    path = tmp_path / "policoro.txt"
    path.write_text(POLICORO.text, encoding="utf-8")
    argv = ["ask", "-q", QUESTION, "--docs", str(path), "--max-new-tokens", "6", "--cache", "none"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["not_in_documents"] == ["Slinzega"]
    assert main(argv) == 0
    assert 'the documents never mention: "Slinzega"' in capsys.readouterr().out


def test_eval_rows_see_every_document_and_calibration_fits_around_the_gate(tmp_path):
    cited = [Citation(index=2, doc_id="b", title="", supported=True)]
    docs = [Document(id=x, text=x) for x in "abc"]
    # the cited document at its prompt place, the others fill the rest: none is lost
    assert [d.id for d in prompt_documents(cited, docs)] == ["a", "b", "c"]
    assert [d.id for d in prompt_documents([], docs)] == ["a", "b", "c"]
    base = {"lexical_score": 1.0, "key_supported": True, "lift": 0.5, "coverage": 1.0}
    right = [{**base, "correct": True, "named": 1.0}] * 9 + [
        {**base, "correct": True, "named": 0.0}
    ]
    wrong = [{**base, "correct": False, "lexical_score": 0.2, "named": 1.0}] * 5
    wrong += [{**base, "correct": False, "named": 0.0}] * 5
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"answerable": right, "unanswerable": wrong}))
    data = labelled([path])
    assert sum(f.named == 0.0 for f, _ in data) == 6
    use = ("lexical", "answer", "lift")
    rule = fit(data, 1.0, 0.9, use, True, unanswerable=0.8, named_gate=True)
    assert rule.named_gate
    grounded = [rule.probability(f) >= 0.5 for f, _ in data]
    assert grounded == [True] * 9 + [False] * 11  # the gated right answer is lost, counted
    # a row the gate refuses is never a cut, but counts against the floors: no bias
    # grounds both right answers, so the best keeps one and refuses the negative
    rows = [(None, 1), (None, 1), (None, 0)]
    assert best_bias([None, 1.0, -1.0], rows, 1.0) == pytest.approx(0.0)  # type: ignore[arg-type]
