"""``ragsnap ask --cache`` and ``ragsnap cache stats|clear`` in-process, on the loaded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragsnap.cli import main
from ragsnap.engine.engine import RagSnapEngine

pytestmark = pytest.mark.model


@pytest.fixture
def reuse_model(engine, monkeypatch):
    """``RagSnapEngine.from_config`` builds on the session's loaded model instead of
    loading again (the store and the rest of the configuration as the command gives them)."""
    from ragsnap.cache import open_store

    def from_config(cls, config, *, store=None, **_options):
        store = store or open_store(config.cache_url, key=config.cache_secret)
        return cls(engine.loaded, store, config)

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(from_config))


def run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_ask_caches_and_the_cache_commands_see_it(reuse_model, tmp_path: Path, capsys, monkeypatch):
    doc = tmp_path / "tides.txt"
    doc.write_text("Tides are caused mainly by the gravity of the Moon pulling on the oceans.")
    url = f"file://{tmp_path / 'kv'}"
    ask = [
        "ask",
        "-q",
        "What causes tides?",
        "--docs",
        str(doc),
        "--budget",
        "48",
        "--window",
        "8",
        "--max-new-tokens",
        "4",
        "--json",
        "--no-document-cache",  # the per-document tier's entries are counted in its own tests
    ]
    first = run(capsys, *ask, "--cache", url)
    again = run(capsys, *ask, "--cache", url)
    assert (first["stats"]["cache"], again["stats"]["cache"]) == ("miss", "hit")
    assert again["answer"] == first["answer"] and again["stats"]["cache_bytes_read"] > 0
    assert run(capsys, *ask, "--cache", "none")["stats"]["cache"] == "off"
    monkeypatch.setenv("RAGSNAP_CACHE_URL", url)  # the default store when --cache is absent
    assert run(capsys, *ask)["stats"]["cache"] == "hit"

    other = run(capsys, *ask, "--namespace", "other", "--no-prefix-cache")
    assert other["stats"]["cache"] == "miss"
    stats = run(capsys, "cache", "stats", "--cache", url, "--json")
    # kv and the document set's seen marker (its prefix is written once the set recurs),
    # kv in "other"
    assert stats["backend"] == "file" and stats["entries"] == 3
    assert run(capsys, "cache", "stats", "--namespace", "other", "--json")["entries"] == 1
    assert main(["cache", "clear", "--namespace", "other"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert run(capsys, "cache", "stats", "--json")["entries"] == 2
    # a new question over the same document, in new processes: the set recurs, so this
    # miss writes its prefix entry, which the next question's process finds
    asked = [*ask[:2], "Why do tides happen?", *ask[3:]]
    assert run(capsys, *asked)["stats"]["cache"] == "miss"
    asked[2] = "What pulls on the oceans?"
    assert run(capsys, *asked)["stats"]["cache"] == "prefix-hit"
    assert run(capsys, "cache", "stats", "--json")["entries"] == 5  # + 2 kv, + the prefix


def test_bad_cache_url_is_one_clear_line(capsys, tmp_path: Path):
    doc = tmp_path / "d.txt"
    doc.write_text("text")
    assert main(["ask", "-q", "q?", "--docs", str(doc), "--cache", "ftp://x"]) == 2
    err = capsys.readouterr().err
    assert "unsupported cache URL scheme 'ftp'" in err and "Traceback" not in err


def test_bench_cache_prints_every_field(reuse_model, capsys, tmp_path: Path):
    out = run(
        capsys,
        "bench",
        "cache",
        "--context",
        "400",
        "--budget",
        "64",
        "--repeats",
        "1",
        "--cache",
        f"file://{tmp_path}",
        "--json",
    )
    assert {
        "context",
        "budget",
        "ttft_miss_s",
        "ttft_hit_s",
        "ttft_prefix_hit_s",
        "read_floor_s",
        "bytes_compressed",
        "bytes_prefix",
        "bytes_full_kv",
    } <= set(out)
    assert 300 < out["prompt_tokens"] <= 400
    # the compressed entry is the kept share of the full KV plus a small overhead
    assert 1.0 < out["compressed_over_expected"] < 1.1
    assert out["bytes_prefix"] < out["bytes_full_kv"]
    assert out["prefix_hit_prefill_tokens"] == 32  # the default window; the tail is shorter
    assert list(tmp_path.rglob("*.kv")) == []  # the benchmark cleans up after itself
