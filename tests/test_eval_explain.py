"""Why an answer scored what it did: the per-question view of report.md / questions.md."""

from __future__ import annotations

from ragsnap.eval.explain import explain_score, near_misses
from ragsnap.eval.metrics import score_answer
from ragsnap.eval.questions import REPORT_ITEMS, question_section


def test_fxia_against_gold_xia_scores_zero_and_says_why():
    answer = "FXIa is the target of the antibody."
    assert score_answer("factoid", answer, ["XIa"])["accuracy"] == 0.0
    why = explain_score("factoid", answer, ["XIa"])
    assert "no gold form ['xia']" in why and "'fxia' ⊃ 'xia'" in why and "not accepted" in why


def test_factoid_why_names_the_candidate_and_the_synonym():
    why = explain_score("factoid", "Thrombin, or factor XIa", ["factor XIa", "FXIa"])
    assert why == "lenient (candidate 2): 'factor xia' contains gold 'factor xia'"
    assert explain_score("factoid", "FXIa.", ["factor XIa", "FXIa"]).startswith("strict")


def test_yesno_list_and_needle_reasons():
    assert "parsed label 'no'" in explain_score("yesno", "No, it is not.", ["yes"])
    assert "wrong" in explain_score("yesno", "No, it is not.", ["yes"])
    assert "no yes/no/maybe word" in explain_score("yesno", "Unclear.", ["no"])
    why = explain_score("list", "BRCA1, TP53", ["x"], [["BRCA1"], ["EGFR"]])
    assert why.startswith("1/2 entities") and "'egfr' missing" in why
    assert "not among the digit runs ['123']" in explain_score("needle", "it is 123", ["4567"])
    assert near_misses("anti-XIa", ["XIa"]) == []  # found as a whole word: no near miss


def _record(item, press, budget, answer, gold="XIa"):
    scores = score_answer("factoid", answer, [gold])
    return {
        "item_id": item, "type": "factoid", "press": press, "budget": budget,
        "question": f"Which factor ({item})?", "answer": answer, "gold_answers": [gold],
        "scores": scores,
    }  # fmt: skip


def test_report_shows_a_capped_list_and_questions_md_all(tmp_path):
    records = []
    for i in range(REPORT_ITEMS + 2):
        records += [
            _record(f"q{i:02d}", "snapkv", 64, "FXIa"),
            _record(f"q{i:02d}", "full", None, "XIa"),
        ]
    section = "\n".join(question_section(tmp_path, records))
    assert section.count("<details>") == REPORT_ITEMS
    assert f"The first {REPORT_ITEMS} of {REPORT_ITEMS + 2} items" in section
    page = (tmp_path / "questions.md").read_text()
    assert page.count("<details>") == REPORT_ITEMS + 2
    block = page.split("<details>")[1]
    full_row, snap_row = [
        line
        for line in block.splitlines()
        if line.startswith("| full") or line.startswith("| snapkv")
    ]
    assert full_row.startswith("| full | all | accuracy 1 | XIa |")
    assert (
        snap_row.startswith("| snapkv | 64 | accuracy 0 | FXIa |") and "'fxia' ⊃ 'xia'" in snap_row
    )
