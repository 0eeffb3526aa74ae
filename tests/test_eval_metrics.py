"""Scoring functions of `ragsnap eval` on hand-made answers with known scores."""

from __future__ import annotations

import pytest

from ragsnap.eval.aggregate import build_runs
from ragsnap.eval.metrics import (
    contains,
    factoid_scores,
    kept_share,
    list_scores,
    macro_f1,
    needle_scores,
    normalize,
    rouge_l,
    score_answer,
    split_candidates,
    yesno_label,
)


def test_normalize_drops_case_punctuation_articles_and_citations():
    assert normalize("The  BRCA1-gene, [2][3] is (an) Oncogene!") == "brca1 gene is oncogene"
    assert normalize("") == ""
    assert normalize("[1] . , !") == ""


def test_contains_matches_whole_words_only():
    assert contains("It is caused by the BRCA1 gene [1].", "brca1 gene")
    assert not contains("It is caused by BRCA12.", "BRCA1")
    assert not contains("anything", "")  # an empty gold string is never found
    assert not contains("", "BRCA1")


def test_yesno_label_is_the_first_yes_or_no_word():
    assert yesno_label("Yes, it is [1].") == "yes"
    assert yesno_label("NO. Not according to [2].") == "no"
    assert yesno_label("There is no evidence; yes, maybe") == "no"
    assert yesno_label("The documents do not say.") is None
    assert yesno_label("") is None


def test_macro_f1_over_yes_and_no():
    gold = ["yes", "yes", "no", "no"]
    assert macro_f1(gold, ["yes", "yes", "no", "no"], ("yes", "no")) == 1.0
    # always "yes": F1(yes) = 2*2/(4+2) = 2/3, F1(no) = 0
    assert macro_f1(gold, ["yes"] * 4, ("yes", "no")) == pytest.approx(1 / 3)
    # unparsable answers count as wrong for both labels
    assert macro_f1(gold, [None] * 4, ("yes", "no")) == 0.0


def test_factoid_strict_lenient_and_mrr_over_synonyms():
    synonyms = ["interleukin 6", "IL-6"]
    assert factoid_scores("IL-6 [1].", synonyms) == {
        "factoid_strict": 1.0,
        "factoid_lenient": 1.0,
        "factoid_mrr": 1.0,
    }
    second = factoid_scores("TNF-alpha, or interleukin-6 [2]", synonyms)
    assert second == {"factoid_strict": 0.0, "factoid_lenient": 1.0, "factoid_mrr": 0.5}
    assert factoid_scores("TNF-alpha", synonyms)["factoid_mrr"] == 0.0
    empty = factoid_scores("", synonyms)
    assert empty == {"factoid_strict": 0.0, "factoid_lenient": 0.0, "factoid_mrr": 0.0}
    # beyond the fifth candidate does not count
    late = factoid_scores("a1; b2; c3; d4; e5; IL-6", synonyms)
    assert late["factoid_lenient"] == 0.0


def test_split_candidates_on_lists_and_bullets():
    assert split_candidates("- AlphaFold\n- PSIPRED [2]\n* Jpred") == [
        "AlphaFold",
        "PSIPRED",
        "Jpred",
    ]
    assert split_candidates("X, Y and Z.") == ["X", "Y", "Z."]
    assert split_candidates("") == []


def test_list_precision_recall_f1_with_synonym_groups():
    groups = [["AlphaFold"], ["PSIPRED", "PSIPRED Workbench"], ["Jpred", "jpred"]]
    scores = list_scores("AlphaFold, psipred workbench, Rosetta", groups)
    assert scores["list_precision"] == pytest.approx(2 / 3)
    assert scores["list_recall"] == pytest.approx(2 / 3)
    assert scores["list_f1"] == pytest.approx(2 / 3)
    assert list_scores("", groups) == {"list_precision": 0.0, "list_recall": 0.0, "list_f1": 0.0}
    perfect = list_scores("- alphafold\n- PSIPRED\n- JPRED", groups)
    assert perfect["list_f1"] == 1.0


def test_rouge_l_best_reference():
    assert rouge_l("the cat sat on the mat", ["cat sat on mat"]) == 1.0
    # LCS "cat mat" = 2 of 3 answer words and 2 of 4 reference words
    assert rouge_l("cat dog mat", ["cat sat on mat"]) == pytest.approx(
        2 * (2 / 3) * 0.5 / (2 / 3 + 0.5)
    )
    assert rouge_l("", ["cat"]) == 0.0
    assert rouge_l("cat", ["dog", "Cat."]) == 1.0


def test_needle_exact_and_leading_digit_share():
    assert needle_scores(" 7007071.", "7007071") == {"needle_accuracy": 1.0, "needle_partial": 1.0}
    phone = needle_scores(" 7007.", "7007071")
    assert phone["needle_accuracy"] == 0.0 and phone["needle_partial"] == pytest.approx(4 / 7)
    assert needle_scores("70070712", "7007071")["needle_accuracy"] == 0.0  # not a whole digit run
    assert needle_scores("", "7007071") == {"needle_accuracy": 0.0, "needle_partial": 0.0}
    assert needle_scores("1234567 or 7007000", "7007071")["needle_partial"] == pytest.approx(5 / 7)


def test_citation_precision_recall_and_undefined_cases():
    from ragsnap.eval.citation_eval import set_scores

    assert set_scores(["a", "b"], ["a", "c"]) == {"precision": 0.5, "recall": 0.5, "f1": 0.5}
    assert set_scores([], ["a"]) == {"precision": None, "recall": 0.0, "f1": 0.0}
    assert set_scores(["a"], []) == {"precision": 0.0, "recall": None, "f1": None}


def test_kept_share_weights_by_tokens():
    rate = [1.0, 1.0, 0.0, 0.0, 0.5, 0.5]
    assert kept_share(rate, [(0, 2), (2, 4)]) == 0.5
    assert kept_share(rate, [(0, 1), (4, 6)]) == pytest.approx(2 / 3)
    assert kept_share(rate, []) is None


def test_score_answer_by_type():
    assert score_answer("yesno", "No [1].", ["no"])["accuracy"] == 1.0
    assert score_answer("factoid", "It is IL6, not IL-6", ["IL-6"])["accuracy"] == 1.0
    assert score_answer("short", "", ["Paris"])["accuracy"] == 0.0
    assert "accuracy" not in score_answer("summary", "text", ["text"])
    assert score_answer("needle", " 1234567.", ["1234567"])["accuracy"] == 1.0


def _record(item, press, budget, accuracy, kl=0.0):
    return {
        "item_id": item,
        "press": press,
        "budget": budget,
        "type": "short",
        "prompt_tokens": 100,
        "kept_tokens": budget or 100,
        "meta": {},
        "scores": {"accuracy": accuracy, "agreement": 1.0, "kl": kl, "nll_gap": 0.0},
        "stats": {"prefill_s": 1.0, "kv_bytes_full": 100, "kv_bytes_kept": budget or 100},
    }


def test_runs_average_items_and_retention_uses_the_same_items():
    records = [
        _record("a", "full", None, 1.0),
        _record("b", "full", None, 0.0),
        _record("a", "snapkv", 50, 1.0, 0.2),
        _record("b", "snapkv", 50, 1.0, 0.4),
        _record("a", "random", 50, 0.0),
    ]
    runs = build_runs(records, [("full", None), ("snapkv", 50), ("random", 50)])
    by = {(r["press"], r["budget"]): r for r in runs}
    assert by[("full", None)]["metrics"]["accuracy"] == 0.5
    assert by[("snapkv", 50)]["metrics"]["kl"] == pytest.approx(0.3)
    assert by[("snapkv", 50)]["retention"]["accuracy"] == 2.0
    # random only ran on item "a", where the full cache scored 1.0
    assert by[("random", 50)]["n"] == 1 and by[("random", 50)]["retention"]["accuracy"] == 0.0
    assert by[("snapkv", 50)]["metrics"]["kv_kept_share"] == 0.5


def test_versus_pairs_items_with_the_baseline_at_the_same_budget():
    records = [
        _record("a", "snapkv", 50, 0.0, 0.4),
        _record("b", "snapkv", 50, 1.0, 0.2),
        _record("a", "snapkv", 80, 1.0, 0.1),
        _record("a", "ragsnap", 50, 1.0, 0.1),
        _record("b", "ragsnap", 50, 0.0, 0.2),
        _record("c", "ragsnap", 50, 1.0, 9.0),  # no snapkv record for "c": not paired
        _record("a", "ragsnap", 80, 1.0, 0.3),
    ]
    runs = build_runs(records, [("snapkv", 50), ("snapkv", 80), ("ragsnap", 50), ("ragsnap", 80)])
    by = {(r["press"], r["budget"]): r for r in runs}
    assert "versus" not in by[("snapkv", 50)]
    at50 = by[("ragsnap", 50)]["versus"]
    assert at50["baseline"] == "snapkv" and at50["n"] == 2
    assert at50["kl_ratio"] == pytest.approx(0.15 / 0.3)
    assert (at50["kl_lower"], at50["kl_higher"]) == (1, 0)
    assert (at50["accuracy_won"], at50["accuracy_lost"]) == (1, 1)
    at80 = by[("ragsnap", 80)]["versus"]
    assert at80["kl_ratio"] == pytest.approx(3.0) and at80["kl_higher"] == 1
    assert "versus" not in build_runs(records, [("ragsnap", 50)], baseline="h2o")[0]
