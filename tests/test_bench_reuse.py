"""``ragsnap bench reuse`` on a tiny random model: answers and citations scored as the eval
scores them, paired against the cold run with intervals; data sets mixed; bad input named."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ragsnap.cli import main
from ragsnap.cli.bench.reuse_items import load_bench_items
from ragsnap.cli.bench.reuse_scores import paired_difference


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randint(2, 90)}" for _ in range(n))


def _hotpot(path: Path, count: int, seed: int = 1) -> Path:
    rng = random.Random(seed)
    records = [
        {
            "_id": f"h{i}",
            "question": f"{_words(rng, 6)} ?",
            "answer": f"t{rng.randint(2, 90)}",
            "title_a": f"t{i + 2}",
            "para_a": [f"{_words(rng, 12)} . " for _ in range(6)],
            "title_b": f"t{i + 40}",
            "para_b": [f"{_words(rng, 12)} . " for _ in range(3)],
            "distractors": [[f"t{i + 60}", [f"{_words(rng, 12)} . "], 1.0]],
        }
        for i in range(count)
    ]
    path.write_text(json.dumps(records))
    return path


def _bioasq(path: Path, count: int, seed: int = 2) -> Path:
    rng = random.Random(seed)
    questions = [
        {
            "id": f"b{i}",
            "type": "factoid" if i % 4 else "yesno",
            "body": f"{_words(rng, 5)} ?",
            "documents": [f"http://www.ncbi.nlm.nih.gov/pubmed/{1000 + i}"],
            "snippets": [
                {
                    "text": " . ".join(_words(rng, 10) for _ in range(5)),
                    "document": f"http://www.ncbi.nlm.nih.gov/pubmed/{1000 + i}",
                }
            ],
            "exact_answer": [[f"t{rng.randint(2, 90)}"]],
            "ideal_answer": ["x"],
        }
        for i in range(count)
    ]
    path.write_text(json.dumps({"questions": questions}))
    return path


def test_items_of_several_data_sets_are_interleaved_after_the_held_out_ones(tmp_path) -> None:
    hotpot, bioasq = _hotpot(tmp_path / "h.json", 5), _bioasq(tmp_path / "b.json", 8)
    items = load_bench_items([hotpot, bioasq], None, ("factoid", "short"), 1, 0)
    assert [d for d, _ in items[:4]] == ["hotpotqa", "bioasq", "hotpotqa", "bioasq"]
    assert items[0][1].id == "h1"  # the first item of each set is held out
    assert {i.type for _, i in items} == {"short", "factoid"}  # yes/no left out
    assert all(i.answers and i.gold_doc_ids for _, i in items)


def test_paired_difference_counts_both_sides_and_brackets_the_mean() -> None:
    same = paired_difference([1.0, 0.0, 1.0], [1.0, 0.0, 1.0])
    assert same["mean"] == 0 and same["ci95"] == [0.0, 0.0] and same["sign_p"] is None
    mixed = paired_difference([1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0])
    assert (mixed["better"], mixed["worse"]) == (1, 2)
    assert mixed["ci95"][0] <= mixed["mean"] == -0.2 <= mixed["ci95"][1]


def test_bench_reuse_scores_answers_and_citations_against_cold(tiny, tmp_path, capsys) -> None:
    hotpot, bioasq = _hotpot(tmp_path / "h.json", 4), _bioasq(tmp_path / "b.json", 6)
    argv = ["bench", "reuse", "--data", str(hotpot), "--data", str(bioasq), "--pool", "4"]
    argv += ["--docs", "2", "--questions", "6", "--context", "384", "--budget", "48"]
    argv += ["--max-new-tokens", "4", "--shares", "0,0.5,1", "--needle-every", "3", "--json"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["questions"] == 6 and report["needle_questions"] == 2
    assert report["datasets"] == {"bioasq": 3, "hotpotqa": 3}
    for name, row in report["shares"].items():
        for field in ("accuracy", "citation_f1", "needle_found"):
            assert 0 <= row[field] <= 1, (name, field)
    scores = report["scores"]
    assert scores["accuracy"]["n"] == scores["citation_f1"]["n"] == 4  # needles not counted
    assert set(report["scores_by_dataset"]) == {"bioasq", "hotpotqa"}
    # share 1.0 recomputes every document token: the cold prefix, the cold answers
    assert report["shares"]["1.0"]["answer_agreement"] == 1.0
    needles = report["needle_minus_cold"]  # paired by question, as the answers are
    assert needles["1.0"]["mean"] == 0 and needles["1.0"]["better"] == needles["1.0"]["worse"] == 0
    assert needles["0.0"]["better"] + needles["0.0"]["worse"] <= 2
    for score in ("accuracy", "citation_f1"):
        full = scores[score]["1.0"]
        assert full["mean"] == scores[score]["cold"]
        assert full["minus_cold"]["mean"] == 0 and full["minus_cold"]["ci95"] == [0.0, 0.0]
        assert full["minus_cold"]["better"] == full["minus_cold"]["worse"] == 0
        low, high = scores[score]["0.0"]["minus_cold"]["ci95"]
        assert low <= scores[score]["0.0"]["minus_cold"]["mean"] <= high


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--data", "no-such-file.json"], "no-such-file.json"),
        (["--skip", "-1"], "--skip"),
        (["--types", ","], "--types"),
    ],
)
def test_bench_reuse_names_bad_input(tiny, tmp_path, capsys, extra, says) -> None:
    hotpot = _hotpot(tmp_path / "h.json", 4)
    argv = ["bench", "reuse", "--data", str(hotpot), "--pool", "4", "--docs", "2", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_needle_digits_set_the_length_of_every_passages_number(tiny, tmp_path) -> None:
    from ragsnap.cli.bench.reuse_items import NEEDLE_DIGITS, build_passages

    items = load_bench_items([_hotpot(tmp_path / "h.json", 4)], None, ("short",), 0, 0)
    tokenizer = tiny.runtime.tokenizer
    default = build_passages(tokenizer, items, 60, 0)
    short = build_passages(tokenizer, items, 60, 0, digits=4)
    assert all(len(p.needle_value) == NEEDLE_DIGITS == 7 for p in default)
    for passage in short:
        assert len(passage.needle_value) == 4 and passage.needle_value.isdigit()
        assert passage.needle_value in passage.doc.text
