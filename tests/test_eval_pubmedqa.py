"""PubMedQA: loading, format guessing, and yes/no/maybe scoring (synthetic files)."""

from __future__ import annotations

import json

import pytest

from ragsnap.errors import InputError
from ragsnap.eval.aggregate import summarize
from ragsnap.eval.datasets import guess_format, load_items
from ragsnap.eval.metrics import score_answer, yesno_label


def _write(path, data):
    path.write_text(json.dumps(data, indent=4), encoding="utf-8")
    return path


def test_items_hold_the_contexts_as_documents_and_the_decision_as_gold(tmp_path):
    path = _write(
        tmp_path / "test_set.json",
        {
            "111": {
                "QUESTION": "Is X safe?",
                "CONTEXTS": ["Aim text.", "", "Result text."],
                "LABELS": ["AIMS", "EMPTY", "RESULTS"],
                "final_decision": "Maybe",
                "LONG_ANSWER": "Perhaps.",
            },
            "222": {"QUESTION": "Q?", "CONTEXTS": ["c"], "final_decision": "unsure"},
            "333": {"QUESTION": " ", "CONTEXTS": ["c"], "final_decision": "yes"},
        },
    )
    loaded = load_items("pubmedqa", path)
    (item,) = loaded.items
    assert (item.id, item.type, item.answers) == ("111", "yesno", ["maybe"])
    assert item.question == "Is X safe? Answer yes, no or maybe, then explain briefly."
    assert [(d.id, d.title, d.text) for d in item.documents] == [
        ("111-1", "Aims", "Aim text."),
        ("111-3", "Results", "Result text."),
    ]
    assert item.gold_doc_ids == ["111-1", "111-3"]
    assert item.metadata["long_answer"] == "Perhaps."
    assert sorted(m.where for m in loaded.malformed) == ["test_set.json#222", "test_set.json#333"]


def test_a_list_is_not_pubmedqa(tmp_path):
    with pytest.raises(InputError, match="PubMed id -> PubMedQA record"):
        load_items("pubmedqa", _write(tmp_path / "x.json", [1, 2]))


def test_format_guessing_tells_the_data_sets_apart(tmp_path):
    pubmed = _write(tmp_path / "p.json", {"1": {"QUESTION": "q", "CONTEXTS": ["c"]}})
    bioasq = _write(tmp_path / "b.json", {"questions": [{"body": "QUESTION"}]})
    hotpot = _write(tmp_path / "h.json", [{"_id": "a"}])
    kv = tmp_path / "kv.jsonl"
    kv.write_text(json.dumps({"ordered_kv_records": [["a", "b"]], "key": "a", "value": "b"}))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"id": 1, "question": "q"}))
    folder = tmp_path / "folder"
    folder.mkdir()
    _write(folder / "set.json", {"1": {"QUESTION": "q", "CONTEXTS": ["c"]}})
    guesses = [guess_format(p) for p in (pubmed, bioasq, hotpot, kv, plain, folder)]
    assert guesses == ["pubmedqa", "bioasq", "hotpotqa", "kvretrieval", "jsonl", "pubmedqa"]


def test_maybe_is_a_label_and_macro_f1_spans_three_classes():
    assert yesno_label("Maybe; the evidence is mixed.") == "maybe"
    assert yesno_label("No, maybe later") == "no"
    golds, answers = ["yes", "no", "maybe"], ["Yes.", "Maybe.", "Maybe so."]
    records = [
        {"type": "yesno", "dataset": "pubmedqa", "scores": score_answer("yesno", a, [g])}
        | {"prompt_tokens": 10, "kept_tokens": 10, "stats": {}}
        for g, a in zip(golds, answers, strict=True)
    ]
    metrics = summarize(records)
    assert metrics["accuracy"] == pytest.approx(2 / 3, abs=1e-6)
    # F1: yes 1, no 0, maybe 2/3 -> mean 5/9 (over yes/no only it would be 1/2)
    assert metrics["yesno_macro_f1"] == pytest.approx(5 / 9, abs=1e-6)
