"""``ragsnap bench batch`` on a tiny random model: the report's shape and its byte counts."""

from __future__ import annotations

import json

import pytest

from ragsnap.cli import main
from tests.tiny_models import tiny_engine


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


def test_bench_batch_compares_prefix_hits_compressed_in_turn_and_side_by_side(tiny, capsys) -> None:
    args = ["bench", "batch", "--concurrency", "1,3", "--context", "120", "--budget", "32"]
    args += ["--decode-tokens", "2", "--repeats", "1", "--threads", "2", "--compare-tails"]
    args += ["--press", "ragsnap-lookahead"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in report["tails"]] == [1, 3]
    for row in report["tails"]:  # the shared passes are part of either way's time
        assert 0 <= row["shared_s"] <= row["in_turn_s"] and row["side_by_side_s"] > 0
    # one thread has no second core to compress on; an every-query press cannot batch
    assert main([*args, "--threads", "1"]) == 2
    assert "--threads 2" in capsys.readouterr().err
    assert main([*args, "--press", "h2o"]) == 2
    assert "one by one" in capsys.readouterr().err


def test_bench_batch_refuses_bad_concurrency(tiny, capsys) -> None:
    assert main(["bench", "batch", "--concurrency", "two"]) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_bench_load_compares_the_serial_and_the_batched_worker(tiny, capsys) -> None:
    tiny.runtime.stop_ids.clear()  # random weights: every answer runs to its length
    args = ["bench", "load", "--compare-max-batch", "1,3", "--clients", "3", "--requests", "1"]
    args += ["--context", "120", "--max-new-tokens", "5", "--repeat", "0", "--warm"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["runs"]) == {"1", "3"}
    for run in report["runs"].values():
        assert run["answered"] == 3 and run["zero_5xx"]
        assert run["cache"] == {"hit": 3}  # --warm: the timed run finds every prompt stored
    assert report["ratio_to_first"]["1"]["answers_per_s"] == 1.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bench_batch_compares_packed_and_dense_linears(dtype, monkeypatch, capsys) -> None:
    import torch

    from ragsnap.runtime.loading.cpu_linears import (
        HalfWeightLinear,
        PackedLinear,
        can_pack,
        can_pack_half,
        pack_linears,
    )

    if not (can_pack() if dtype == "bfloat16" else can_pack_half()):
        pytest.skip(f"this torch build or CPU cannot pack {dtype} linears")
    engine = tiny_engine("llama")
    engine.runtime.model.to(getattr(torch, dtype))
    linears = pack_linears(engine.runtime.model)
    Packed = PackedLinear if dtype == "bfloat16" else HalfWeightLinear
    monkeypatch.setattr("ragsnap.engine.loading.plain_runtime", lambda **k: engine.runtime)
    import ragsnap.cli.bench.batch as batch

    layouts, real = [], batch.timed_batch

    def timed(engine_, prefills, steps):  # which layout each timed run decoded with
        packed = sum(isinstance(m, Packed) for m in engine_.model.modules())
        layouts.append("packed" if packed == linears else "dense" if packed == 0 else "mixed")
        return real(engine_, prefills, steps)

    monkeypatch.setattr(batch, "timed_batch", timed)
    args = ["bench", "batch", "--concurrency", "1,2", "--context", "120", "--budget", "48"]
    assert main([*args, "--decode-tokens", "2", "--repeats", "1", "--compare-linears"]) == 0
    # the throughput runs, then per concurrency one packed and one dense run
    assert layouts[-4:] == ["packed", "packed", "dense", "dense"]
    report = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in report["linears"]] == [1, 2]
    assert all(
        r["packed_ms_per_step"] > 0 and r["dense_ms_per_step"] > 0 for r in report["linears"]
    )
    # the model is left as it was loaded: every linear packed again
    assert sum(isinstance(m, Packed) for m in engine.runtime.model.modules()) == linears


def test_bench_batch_compare_linears_needs_packed_linears(tiny, capsys) -> None:
    args = ["bench", "batch", "--concurrency", "1", "--context", "120", "--budget", "48"]
    assert main([*args, "--decode-tokens", "2", "--repeats", "1", "--compare-linears"]) == 2
    assert "--compare-linears" in capsys.readouterr().err


def test_bench_batch_compare_pass_alternates_lean_and_tree(monkeypatch, capsys) -> None:
    engine = tiny_engine("qwen2")
    lean = engine.runtime.lean
    assert lean is not None
    monkeypatch.setattr("ragsnap.engine.loading.plain_runtime", lambda **k: engine.runtime)
    import ragsnap.cli.bench.batch as batch

    paths, real = [], batch.timed_batch

    def timed(engine_, prefills, steps):  # which pass each timed run decoded with
        paths.append("lean" if engine_.lean is lean else "tree")
        return real(engine_, prefills, steps)

    monkeypatch.setattr(batch, "timed_batch", timed)
    args = ["bench", "batch", "--concurrency", "1,2", "--context", "120", "--budget", "48"]
    assert main([*args, "--decode-tokens", "2", "--repeats", "1", "--compare-pass"]) == 0
    assert paths[-4:] == ["lean", "lean", "tree", "tree"]
    report = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in report["pass"]] == [1, 2]
    assert all(r["lean_ms_per_step"] > 0 and r["tree_ms_per_step"] > 0 for r in report["pass"])
    assert engine.runtime.lean is lean  # left as loaded


def test_bench_batch_compare_pass_needs_a_llama_family_model(monkeypatch, capsys) -> None:
    engine = tiny_engine("gemma3")
    monkeypatch.setattr("ragsnap.engine.loading.plain_runtime", lambda **k: engine.runtime)
    args = ["bench", "batch", "--concurrency", "1", "--context", "120", "--budget", "48"]
    assert main([*args, "--decode-tokens", "2", "--repeats", "1", "--compare-pass"]) == 2
    assert "--compare-pass" in capsys.readouterr().err


def test_bench_batch_compare_lanes_pads_less_than_one_buffer(tiny, capsys) -> None:
    args = ["bench", "batch", "--concurrency", "1,5", "--context", "600", "--budget", "48"]
    assert main([*args, "--decode-tokens", "2", "--repeats", "1", "--compare-lanes"]) == 0
    report = json.loads(capsys.readouterr().out)
    one, five = report["lanes"]
    assert one["lanes_count"] == one["one_buffer_count"] == 1  # a single full row
    # rows 0 and 4 are full caches of 600 entries, rows 1-3 compressed to about 56
    assert five["lanes_count"] == 2 and five["one_buffer_count"] == 1
    assert five["kv_bytes"] < five["lanes_buffer_bytes"] < 0.7 * five["one_buffer_buffer_bytes"]
    assert five["lanes_ms_per_step"] > 0 and five["one_buffer_ms_per_step"] > 0
    from ragsnap.runtime import decode

    assert decode.LANE_SHARE == 0.5  # left as it was
