"""``ragsnap bench decode`` on a tiny random model: the report's shape and its byte counts."""

from __future__ import annotations

import json

import pytest

from ragsnap.cli import main
from ragsnap.cli.bench.decode import parse_contexts, prompt_of_length
from ragsnap.errors import ConfigError
from tests.tiny_models import HEAD_DIM, KV_HEADS


def test_bench_decode_json(tiny, capsys) -> None:
    code = main(
        [
            "bench",
            "decode",
            "--context",
            "160,224",
            "--budget",
            "96",
            "--window",
            "8",
            "--repeats",
            "2",
            "--decode-tokens",
            "3",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert set(report) == {"model", "device", "budget", "results"}
    assert report["model"] == "tiny-llama" and report["device"] == "cpu" and report["budget"] == 96
    assert [r["context"] for r in report["results"]] == [160, 224]
    per_token = 4 * 2 * KV_HEADS * HEAD_DIM * 4  # layers x (K, V) x heads x dim x float32
    for row in report["results"]:
        assert set(row) == {
            "context",
            "prefill_s",
            "compress_s",
            "decode_ms_full",
            "decode_ms_compressed",
            "decode_ms_floor",
            "kv_bytes_full",
            "kv_bytes_compressed",
        }
        assert row["kv_bytes_full"] == per_token * row["context"]
        assert row["kv_bytes_compressed"] == per_token * 96
        assert 0 < row["compress_s"] < row["prefill_s"]
        assert min(row["decode_ms_full"], row["decode_ms_compressed"], row["decode_ms_floor"]) > 0


def test_bench_decode_table(tiny, capsys) -> None:
    assert (
        main(
            [
                "bench",
                "decode",
                "--context",
                "160",
                "--budget",
                "96",
                "--window",
                "8",
                "--repeats",
                "1",
                "--decode-tokens",
                "2",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model tiny-llama on cpu, budget 96")
    assert lines[2].split()[0] == "160"


def test_prompt_of_length_is_exact(tiny) -> None:
    for n in (96, 97, 300):
        assert len(prompt_of_length(tiny, n)) == n


@pytest.mark.parametrize("text", ["", "abc", "512", "100,4096"])
def test_bad_contexts(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_contexts(text, budget=512)
    assert info.value.field == "context"


def test_bench_bad_press_is_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setattr("ragsnap.engine.loading.plain_runtime", lambda **k: pytest.fail("loaded"))
    assert main(["bench", "decode", "--context", "4096", "--press", "magic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ragsnap: error: unknown press")
