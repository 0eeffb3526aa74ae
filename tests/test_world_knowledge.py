"""The world-knowledge set and the consistency calibration (issue 53): documents never
hold the question's answer, the summary counts what it says, and the replayed verdict
refuses what the engine's would. Tiny inputs; no data file is read."""

from __future__ import annotations

import json
import math
import random

from ragsnap.citations.lift import LiftRule
from ragsnap.eval import consistency_calibrate as cc
from ragsnap.eval.world_knowledge import essay_passages, pick_documents, summarize
from ragsnap.eval.world_questions import WORLD_QUESTIONS
from ragsnap.prompt.documents import Document


def test_the_set_is_large_enough_and_documents_never_hold_the_answer(tmp_path):
    assert len(WORLD_QUESTIONS) >= 60
    assert len({q for q, _ in WORLD_QUESTIONS}) == len(WORLD_QUESTIONS)
    assert all(answers and q.endswith("?") for q, answers in WORLD_QUESTIONS)
    (tmp_path / "a.txt").write_text("One para.\n\n" + "x " * 800 + "\n\nParis is nice.")
    (tmp_path / "LICENSE-x.txt").write_text("not an essay " * 200)
    passages = essay_passages(tmp_path, size=100)
    assert passages and all(p.title == "a" for p in passages)
    pool = [Document(id=str(i), text=f"passage {i} " * 20) for i in range(30)]
    pool.append(Document(id="paris", text="Paris is the capital of France."))
    picked = pick_documents(pool, ("Paris",), 100, lambda t: len(t.split()), random.Random(0))
    assert picked and all("Paris" not in d.text for d in picked)
    assert sum(len(d.text.split()) for d in picked[:-1]) < 100  # stops once enough


def test_the_summary_counts_not_grounded_overall_and_among_right_answers():
    rows = [
        {"correct": True, "grounded": False, "source": "essays", "answer_not_in_documents": ["Bell"], "check_s": 0.1, "total_s": 10.0},
        {"correct": True, "grounded": True, "source": "essays", "answer_not_in_documents": [], "check_s": 0.0, "total_s": 10.0},
        {"correct": False, "grounded": None, "source": "hotpotqa", "answer_not_in_documents": [], "check_s": 0.0, "total_s": 5.0},
    ]  # fmt: skip
    out = summarize(rows)
    assert out["n"] == 3 and out["not_grounded"] == round(2 / 3, 4)
    assert out["right_from_memory_not_grounded"] == 0.5
    assert out["by_source"] == {"essays": 0.5, "hotpotqa": 1.0}
    assert out["check_share_of_answer_time_mean"] == round(0.01 / 3, 5)


def _row(**changes):
    row = {
        "lexical_score": 1.0,
        "key_supported": True,
        "has_key": True,
        "lift": 0.5,
        "question_lift": 0.5,
        "plain": True,
        "kind": 1.0,
        "coverage": 1.0,
        "named": 1.0,
        "answer_missing": {"name": [], "opening": [], "asked": [], "plain": []},
        "documents": {"1": {"title": "T", "text": "pembrolizumab was tested."}},
    }
    return {**row, **changes}


def test_the_replay_refuses_what_the_engine_refuses(tmp_path):
    rule = LiftRule(0.0, 0.0, 0.0, 5.0, 1.0)  # grounded unless a check refuses
    choice = (("name", "opening"), "any_doc", -0.25, "qlift:-0.3")
    assert cc.replay(rule, _row(), *choice)
    missing = {"name": ["Bell"], "opening": [], "asked": [], "plain": []}
    assert not cc.replay(rule, _row(answer_missing=missing), *choice)
    garbled = {"name": ["Pembrol"], "opening": [], "asked": [], "plain": []}
    assert cc.replay(rule, _row(answer_missing=garbled), *choice)  # found in its document
    assert not cc.replay(rule, _row(question_lift=-0.5), *choice)
    assert cc.replay(rule, _row(question_lift=None), *choice)
    unbacked = _row(lexical_score=0.0, key_supported=False, plain=False)
    assert cc.replay(rule, unbacked, *choice)  # lift 0.5 rescues content documents hold
    assert not cc.replay(rule, unbacked, ("name",), "any", -0.25, "off")  # plain only
    assert not cc.replay(rule, {**unbacked, "lift": -0.3}, *choice)
    assert cc.replay(rule, unbacked, (), "off", math.inf, "off")
    # the engine's recorded verdicts: a grounded answer with every sentence unsupported
    answer = "Bell invented it in 1876."
    row = {"model_answer": answer, "grounded": True, "unsupported_sentences": [[0, 25]]}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"answerable": [row], "unanswerable": [{**row, "grounded": False}]}))
    assert cc.contradictions([path]) == {
        "rows": 2,
        "checked": 2,
        "grounded_with_every_sentence_unsupported": 1,
    }


def test_the_replay_refuses_an_unlinked_answer_and_reads_links_from_the_documents(tmp_path):
    """Session 29: ``link`` relations refuse a row whose key sentence's names are not
    linked to the question's subject; rows recorded before it get ``linked`` from every
    prompt document (``--documents``, ``ragsnap.eval.item_documents``)."""
    rule = LiftRule(0.0, 0.0, 0.0, 5.0, 1.0)
    link = (("name", "opening"), "any_doc", -0.25, "link+qlift:-0.3")
    assert cc.replay(rule, _row(linked=True), *link) and cc.replay(rule, _row(linked=None), *link)
    assert not cc.replay(rule, _row(linked=False), *link)
    assert not cc.replay(rule, _row(linked=True, question_lift=-0.5), *link)
    assert cc.replay(rule, _row(linked=False), ("name", "opening"), "any_doc", -0.25, "qlift:-0.3")
    question = "Which village is the lager Fucking Hell named after?"
    row = _row(id="q1", correct=False, question=question)
    row["model_answer"] = "The lager Fucking Hell is named after Chopper Heavy."
    docs = {
        "q1": {
            "docs": [
                {"id": "a", "title": "Black Metal Sacrifice", "text": "Sons of Fucking Hell."},
                {"id": "b", "title": "Chopper Heavy", "text": "Chopper Heavy is a lager."},
            ]
        }
    }
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"answerable": [], "unanswerable": [row]}))
    [(read, label)] = cc.labelled_rows([path], docs)
    assert label == 0 and read["linked"] is False
    docs["q1"]["docs"][0]["text"] += " Chopper Heavy covered it."
    assert cc.labelled_rows([path], docs)[0][0]["linked"] is True
    assert "linked" not in cc.labelled_rows([path])[0][0]  # no documents: left unknown
