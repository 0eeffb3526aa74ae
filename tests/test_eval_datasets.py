"""Loaders of `ragsnap eval` on tiny fixtures written by the tests."""

from __future__ import annotations

import json

import pytest

from ragsnap.errors import InputError
from ragsnap.eval.bioasq import load_bioasq
from ragsnap.eval.datasets import guess_format, load_items

PUBMED = "http://www.ncbi.nlm.nih.gov/pubmed/"


def bioasq_question(qid, kind, pmids, exact, snippet_docs=None, ideal="An ideal answer."):
    snippet_docs = snippet_docs or pmids
    return {
        "id": qid,
        "type": kind,
        "body": f"Question {qid}?",
        "documents": [PUBMED + p for p in pmids],
        "snippets": [
            {"text": f"Snippet {i} of {qid} from {p}.", "document": PUBMED + p}
            for i, p in enumerate(snippet_docs)
        ],
        "exact_answer": exact,
        "ideal_answer": [ideal],
    }


def write_bioasq(tmp_path, questions, name="golden.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"questions": questions}))
    return path


def test_bioasq_groups_snippets_by_pubmed_id_and_unions_gold(tmp_path):
    q = bioasq_question(
        "q1", "factoid", ["11"], [["IL-6", "interleukin 6"]], snippet_docs=["11", "22", "11"]
    )
    items = load_bioasq([write_bioasq(tmp_path, [q])]).items
    assert len(items) == 1
    item = items[0]
    assert sorted(d.id for d in item.documents) == ["11", "22"]
    doc11 = next(d for d in item.documents if d.id == "11")
    assert (
        doc11.title == "11" and "Snippet 0 of q1" in doc11.text and "Snippet 2 of q1" in doc11.text
    )
    assert sorted(item.gold_doc_ids) == ["11", "22"]  # documents + snippet documents
    assert item.answers == ["IL-6", "interleukin 6"]


def test_bioasq_answers_by_type_and_malformed_items_reported(tmp_path):
    questions = [
        bioasq_question("y", "yesno", ["1"], "Yes"),
        bioasq_question("l", "list", ["2"], [["AlphaFold"], ["PSIPRED", "psipred"]]),
        bioasq_question("s", "summary", ["3"], None, ideal="Bees dance."),
        bioasq_question("bad-type", "essay", ["4"], "x"),
        {
            "id": "no-snippets",
            "type": "factoid",
            "body": "Why?",
            "snippets": [],
            "exact_answer": ["a"],
        },
        bioasq_question("bad-yesno", "yesno", ["5"], "maybe"),
        "not an object",
    ]
    loaded = load_bioasq([write_bioasq(tmp_path, questions)])
    by_id = {i.id: i for i in loaded.items}
    assert set(by_id) == {"y", "l", "s"}
    assert by_id["y"].answers == ["yes"]
    assert by_id["l"].answer_groups == [["AlphaFold"], ["PSIPRED", "psipred"]]
    assert by_id["s"].answers == ["Bees dance."]
    reasons = " ".join(m.reason for m in loaded.malformed)
    assert len(loaded.malformed) == 4
    assert "unknown type" in reasons and "no usable snippets" in reasons and "maybe" in reasons


def test_bioasq_padding_reaches_the_target_and_shuffles_with_the_seed(tmp_path):
    questions = [bioasq_question(f"q{i}", "factoid", [str(100 + i)], ["x"]) for i in range(30)]
    path = write_bioasq(tmp_path, questions)

    def words(text: str) -> int:
        return len(text.split())

    padded = load_bioasq([path], context_tokens=60, count_tokens=words, seed=1).items
    item = padded[0]
    assert len(item.documents) > 3
    total = sum(words(f"[{i + 1}] {d.title}\n{d.text}\n\n") for i, d in enumerate(item.documents))
    assert 60 - 12 <= total <= 60
    assert item.gold_doc_ids == ["100"] and "100" in {d.id for d in item.documents}
    again = load_bioasq([path], context_tokens=60, count_tokens=words, seed=1).items[0]
    other = load_bioasq([path], context_tokens=60, count_tokens=words, seed=2).items[0]
    assert [d.id for d in again.documents] == [d.id for d in item.documents]
    assert [d.id for d in other.documents] != [d.id for d in item.documents]


def test_jsonl_loader_reports_bad_lines(tmp_path):
    good = {
        "id": "a",
        "question": "Who?",
        "documents": [{"id": "d1", "title": "T", "text": "Bob did."}],
        "answers": ["Bob"],
        "gold_doc_ids": ["d1"],
    }
    listed = dict(good, id="b", type="list", answers=[["Bob", "Robert"], "Alice"])
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps(dict(good, id="c", documents=[])),
        json.dumps(dict(good, id="d", type="poem")),
        "",
        json.dumps(listed),
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines))
    loaded = load_items("jsonl", path)
    assert [i.id for i in loaded.items] == ["a", "b"]
    assert loaded.items[0].type == "short" and loaded.items[0].gold_doc_ids == ["d1"]
    assert loaded.items[1].answer_groups == [["Bob", "Robert"], ["Alice"]]
    assert [m.where for m in loaded.malformed] == ["set.jsonl:2", "set.jsonl:3", "set.jsonl:4"]
    assert guess_format(path) == "jsonl"


def test_hotpotqa_gold_paragraphs_and_distractors(tmp_path):
    record = {
        "_id": "h1",
        "question": "Which is older?",
        "answer": "Rome",
        "title_a": "Rome",
        "para_a": ["Rome is old.", " Very old."],
        "title_b": "Paris",
        "para_b": ["Paris is younger."],
        "supporting_facts": [[0], [0]],
        "distractors": [["Oslo", ["Oslo is cold."], 1.0], ["Rome", ["duplicate"], 0.5]],
    }
    path = tmp_path / "hotpot.json"
    path.write_text(json.dumps([record, {"_id": "broken"}]))
    assert guess_format(path) == "hotpotqa"
    loaded = load_items("hotpotqa", path)
    item = loaded.items[0]
    assert sorted(d.id for d in item.documents) == ["Oslo", "Paris", "Rome"]
    assert next(d for d in item.documents if d.id == "Rome").text == "Rome is old. Very old."
    assert item.gold_doc_ids == ["Rome", "Paris"] and item.answers == ["Rome"]
    assert len(loaded.malformed) == 1


def test_missing_data_is_an_input_error(tmp_path):
    with pytest.raises(InputError):
        load_items("bioasq", tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(InputError):
        load_items("bioasq", tmp_path / "bad.json")
