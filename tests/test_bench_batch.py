"""``ragsnap bench batch`` on a tiny random model: the report's shape and its byte counts."""

from __future__ import annotations

import json

from ragsnap.cli import main


def test_bench_batch_reports_throughput_bytes_and_gaps(tiny, capsys) -> None:
    args = ["bench", "batch", "--concurrency", "1,2,3", "--context", "160", "--budget", "48"]
    args += ["--decode-tokens", "3", "--repeats", "1", "--gap-chunks", "32,64", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["cache"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(k, c) for k in ("compressed", "full") for c in (1, 2, 3)}
    for kind in ("compressed", "full"):
        assert rows[(kind, 1)]["speedup_vs_single"] == 1.0
        # the rows hold their caches: three rows hold three times one row's bytes
        one, three = rows[(kind, 1)]["kv_bytes_peak"], rows[(kind, 3)]["kv_bytes_peak"]
        assert three == 3 * one
    assert rows[("compressed", 1)]["kv_bytes_peak"] < rows[("full", 1)]["kv_bytes_peak"]
    assert [g["chunk"] for g in report["gaps"]] == [32, 64]
    assert all(g["rows"] == 3 and g["while_prefilling"]["p95_ms"] > 0 for g in report["gaps"])


def test_bench_batch_refuses_bad_concurrency(tiny, capsys) -> None:
    assert main(["bench", "batch", "--concurrency", "two"]) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_bench_load_compares_the_serial_and_the_batched_worker(tiny, capsys) -> None:
    tiny.stop_ids.clear()  # random weights: every answer runs to its length
    args = ["bench", "load", "--compare-max-batch", "1,3", "--clients", "3", "--requests", "1"]
    args += ["--context", "120", "--max-new-tokens", "5", "--repeat", "0", "--warm"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["runs"]) == {"1", "3"}
    for run in report["runs"].values():
        assert run["answered"] == 3 and run["zero_5xx"]
        assert run["cache"] == {"hit": 3}  # --warm: the timed run finds every prompt stored
    assert report["ratio_to_first"]["1"]["answers_per_s"] == 1.0
