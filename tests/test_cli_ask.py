"""``ragsnap ask`` end to end: the console script once, ``main()`` in-process otherwise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ragsnap.cli import main
from ragsnap.engine.engine import RagSnapEngine

TIDES = "Tides are caused mainly by the gravity of the Moon pulling on the oceans."
BEES = "Honeybees tell each other where flowers are by dancing in the hive."


@pytest.fixture
def docs(tmp_path: Path) -> list[str]:
    tides = tmp_path / "tides.txt"
    tides.write_text(TIDES, encoding="utf-8")
    more = tmp_path / "more.jsonl"
    more.write_text(
        json.dumps({"id": "bees", "title": "Honeybees", "text": BEES}) + "\n", encoding="utf-8"
    )
    return [str(tides), str(more)]


@pytest.fixture
def no_model_load(monkeypatch):
    """Error paths must fail before the model is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for input that is invalid")

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(refuse))


def ask(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ask", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.model
def test_ask_json_from_the_console_script(docs) -> None:
    command = [
        sys.executable,
        "-m",
        "ragsnap",
        "ask",
        "--question",
        "What causes tides?",
        "--docs",
        *docs,
        "--press",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "16",
        "--max-new-tokens",
        "24",
        "--device",
        "cpu",
        "--json",
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert set(payload) >= {"answer", "citations", "stats", "grounded", "grounded_score"}
    assert payload["answer"].strip()
    for citation in payload["citations"]:
        assert set(citation) == {
            "index",
            "doc_id",
            "title",
            "kept_share",
            "score",
            "source",
            "supported",
            "sentences",
            "quotes",
            "spans",
            "unsupported",
        }
        assert citation["doc_id"] in {"tides", "bees"}
    stats = payload["stats"]
    required = {
        "press",
        "budget",
        "prompt_tokens",
        "kept_tokens",
        "prefill_s",
        "compress_s",
        "ttft_s",
        "decode_ms_per_token",
        "kv_bytes_full",
        "kv_bytes_kept",
    }
    assert required <= set(stats)
    assert stats["press"] == "snapkv" and stats["budget"] == 48 and stats["kept_tokens"] == 48
    assert stats["prompt_tokens"] > 48
    assert stats["kv_bytes_kept"] < stats["kv_bytes_full"]


@pytest.mark.model
def test_ask_streams_the_answer_then_a_summary(engine, docs, capsys, monkeypatch) -> None:
    # reuse the session's loaded model instead of loading a second copy
    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(lambda cls, *a, **k: engine))
    code, out, err = ask(
        capsys,
        "-q",
        "What causes tides?",
        "--docs",
        *docs,
        "--press",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "16",
        "--max-new-tokens",
        "24",
    )
    assert code == 0, err
    # progress on stderr while the model loads, then the answer on stdout
    assert re.search(r"ragsnap: loading model embedded \(device auto, \d+ thread\(s\)\)", err)
    assert "ragsnap: model ready in" in err
    answer, _, summary = out.partition("\n---\n")
    assert answer.strip()
    assert "press snapkv: kept 48/" in summary
    assert "prefill" in summary and "ms/token" in summary


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-q", "Why?", "--docs", "MISSING"], "document file not found: MISSING"),
        (["-q", "   ", "--docs", "DOC"], "question is empty"),
        (["-q", "Why?", "--docs", "DOC", "--press", "magic"], "unknown press 'magic'"),
        (
            [
                "-q",
                "Why?",
                "--docs",
                "DOC",
                "--press",
                "snapkv",
                "--budget",
                "16",
                "--window",
                "32",
            ],
            "budget (16) must be at least the window (32)",
        ),
        (["-q", "Why?", "--docs", "BAD_JSONL"], "bad.jsonl:2: not valid JSON"),
        (["-q", "Why?"], "no documents"),
        (
            ["-q", "Why?", "--docs", "DOC", "--speculate", "17"],
            "--speculate: Input should be less than or equal to 16",
        ),
        (
            ["-q", "Why?", "--docs", "DOC", "--layer-profile", "MISSING"],
            "layer profile not found: MISSING",
        ),
    ],
)
def test_ask_bad_input_is_one_clear_line(tmp_path, capsys, no_model_load, argv, message) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(TIDES, encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    paths = {"DOC": str(doc), "BAD_JSONL": str(bad), "MISSING": str(tmp_path / "missing.txt")}
    argv = [paths.get(a, a) for a in argv]
    message = message.replace("MISSING", paths["MISSING"])
    code, out, err = ask(capsys, *argv)
    assert code != 0
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ragsnap: error: ") and message in lines[0]
    assert "Traceback" not in err


def test_console_script_error_has_no_traceback(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ragsnap", "ask", "-q", "Why?", "--docs", str(tmp_path / "nope.md")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert (
        done.stderr.strip().splitlines()[-1].startswith("ragsnap: error: document file not found")
    )


def test_ask_drafts_by_default_and_says_how_many_drafted_tokens_were_kept(
    tiny, docs, capsys, monkeypatch
) -> None:
    given = {}

    def from_config(cls, config, **_options):
        given.update(config.model_dump())
        return RagSnapEngine(tiny.loaded, None, config)

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(from_config))
    argv = ["-q", "Why?", "--docs", *docs, "--budget", "64", "--max-new-tokens", "12"]
    code, out, err = ask(capsys, *argv, "--cache", "none")
    assert code == 0, err
    assert (given["speculate"], given["speculate_ngrams"]) == (8, True)
    assert re.search(r"ms/token \(\d+ of [1-9]\d* drafted tokens kept\)", out), out
    code, out, err = ask(capsys, *argv, "--cache", "none", "--speculate", "0")
    assert code == 0 and given["speculate"] == 0 and "drafted tokens kept" not in out
