"""``ragsnap bench speculate`` on a tiny model: every mode and batch size, the same answers."""

from __future__ import annotations

import json

from ragsnap.cli import main
from tests.test_bench_peer import hotpot_records


def test_bench_compares_modes_at_each_batch_size_on_the_same_answers(tiny, tmp_path, capsys):
    data = tmp_path / "hotpot.json"
    data.write_text(json.dumps(hotpot_records(4)))
    argv = ["bench", "speculate", "--data", str(data), "--prompts", "2", "--context-tokens", "80"]
    argv += ["--concurrency", "1,2", "--speculate", "0,4,4+ngrams", "--max-new-tokens", "6"]
    argv += ["--budget", "32", "--repeats", "1", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["answers"] == 4 and report["press"] == "ragsnap-lookahead"
    rows = {(r["concurrency"], r["speculate"]): r for r in report["results"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("0", "4", "4+ngrams")}
    for (c, mode), row in rows.items():
        assert row["same_answer"] == 1.0 and row["tokens_per_s"] > 0
        if mode == "0":
            assert row["speedup"] == 1.0 and row["kept_share"] is None
            assert row["tokens_per_pass"] <= c
    # the lookahead's tokens were fed, and the first pass kept some: more than a token a pass
    assert rows[(1, "4")]["kept_share"] > 0 and rows[(1, "4")]["tokens_per_pass"] > 1


def test_bench_refuses_bad_modes_and_levels(tiny, tmp_path, capsys):
    data = tmp_path / "hotpot.json"
    data.write_text(json.dumps(hotpot_records(2)))
    for option, value in (
        ("--speculate", "4+grams"),
        ("--speculate", "17"),
        ("--concurrency", "0"),
    ):
        assert main(["bench", "speculate", "--data", str(data), option, value]) == 2
        assert option in capsys.readouterr().err
