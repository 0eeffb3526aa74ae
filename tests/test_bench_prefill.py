"""``ragsnap bench prefill`` on a tiny random model: presses side by side, drafts counted."""

from __future__ import annotations

import json

from ragsnap.cli import main


def test_bench_prefill_reports_each_press_against_the_first(tiny, capsys) -> None:
    argv = ["bench", "prefill", "--context", "160,224", "--budget", "96", "--repeats", "2"]
    code = main([*argv, "--press", "snapkv,ragsnap-lookahead", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["model"] == "tiny-llama" and report["budget"] == 96 and report["threads"] >= 1
    assert [row["context"] for row in report["results"]] == [160, 224]
    for row in report["results"]:
        assert set(row["prefill_s"]) == {"snapkv", "ragsnap-lookahead"}
        assert min(row["prefill_s"].values()) > 0
        assert row["ratio_to_first"]["snapkv"] == 1.0
        assert row["drafted_tokens"]["snapkv"] == 0
        assert 1 <= row["drafted_tokens"]["ragsnap-lookahead"] <= 8


def test_bench_prefill_names_a_bad_press(tiny, capsys) -> None:
    argv = ["bench", "prefill", "--context", "160", "--budget", "96", "--press", "snapkv,zip"]
    assert main(argv) == 2
    assert "zip" in capsys.readouterr().err
