"""Careless command lines: every expected failure is one line on stderr and exit status 2,
and the corpus loader never leaves its folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ragsnap.cli import main
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.errors import ModelLoadError


@pytest.fixture
def doc(tmp_path: Path) -> str:
    path = tmp_path / "tides.txt"
    path.write_text("Tides are caused mainly by the gravity of the Moon.", encoding="utf-8")
    return str(path)


@pytest.fixture
def no_model_load(monkeypatch):
    """These failures must come before any model is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for input that is invalid")

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(refuse))
    monkeypatch.setattr("ragsnap.runtime.loading.models.load_model", refuse)
    monkeypatch.setattr("ragsnap.engine.loading.load_model", refuse)  # eval, calibrate...


def one_line_exit_2(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    # one error line, last; before it at most serve's "ragsnap: loading ..." progress line
    assert lines and lines[-1].startswith("ragsnap: error: "), lines
    progress = ("ragsnap: loading ", "ragsnap: model ready")
    assert all(line.startswith(progress) for line in lines[:-1]), lines
    return lines[-1]


def test_a_non_utf8_layer_profile_is_one_line(tmp_path, doc, capsys, no_model_load):
    profile = tmp_path / "profile.json"
    profile.write_bytes(b"\xff\xfe{\x00\x80")
    err = one_line_exit_2(
        ["ask", "-q", "Why?", "--docs", doc, "--layer-profile", str(profile)], capsys
    )
    assert "not UTF-8" in err


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--temperature", "-1"),
        ("--temperature", "3"),
        ("--top-p", "0"),
        ("--top-p", "nan"),
        ("--seed", str(2**70)),
    ],
)
def test_bad_sampling_values_are_one_parser_line(doc, capsys, no_model_load, option, value):
    with pytest.raises(SystemExit) as exited:  # refused while parsing: no model is loaded
        main(["ask", "-q", "Why?", "--docs", doc, option, value])
    assert exited.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"ragsnap ask: error: argument {option}: ") and value in last


def test_a_zero_answer_length_is_one_line(doc, capsys, no_model_load):
    err = one_line_exit_2(["ask", "-q", "Why?", "--docs", doc, "--max-new-tokens", "0"], capsys)
    assert "--max-new-tokens" in err


@pytest.mark.parametrize("query", ["ttl=abc", "chunk_bytes=much", "backoff=soon"])
def test_a_bad_cache_url_option_is_one_line_for_ask_cache_and_serve(
    doc, capsys, no_model_load, query
):
    url = f"redis://127.0.0.1:1/0?{query}"
    name = query.split("=")[0]
    assert name in one_line_exit_2(["ask", "-q", "Why?", "--docs", doc, "--cache", url], capsys)
    assert name in one_line_exit_2(["cache", "stats", "--cache", url], capsys)
    assert name in one_line_exit_2(["serve", "--cache", url], capsys)  # before the model loads


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(doc, capsys, monkeypatch):
    from ragsnap.runtime.loading.models import load_model

    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model("embedded", device="cuda")
    err = one_line_exit_2(["ask", "-q", "Why?", "--docs", doc, "--device", "cuda"], capsys)
    assert "CUDA" in err


def test_a_truncated_gguf_is_one_line(tmp_path, doc, capsys):
    from ragsnap.runtime.loading.models import embedded_model_path

    whole = embedded_model_path()
    truncated = tmp_path / "cut.gguf"
    with open(whole, "rb") as source:
        truncated.write_bytes(source.read(whole.stat().st_size // 3))
    err = one_line_exit_2(["ask", "-q", "Why?", "--docs", doc, "--model", str(truncated)], capsys)
    assert "cannot load model" in err and str(tmp_path) in err  # the CLI user's own path


@pytest.mark.model
def test_max_new_tokens_over_the_context_says_what_to_change(engine, doc, capsys, monkeypatch):
    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(lambda cls, *a, **k: engine))
    err = one_line_exit_2(
        ["ask", "-q", "Why?", "--docs", doc, "--max-new-tokens", "100000", "--cache", "none"],
        capsys,
    )
    assert "max_new_tokens 100000" in err and str(engine.loaded.context_length) in err
    assert "-9" not in err  # never a negative count of prompt tokens


def test_corpus_loading_stays_inside_its_folder(tmp_path):
    from ragsnap.retrieval.corpus import load_corpus

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the server's private notes", encoding="utf-8")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "tides.txt").write_text("Tides follow the Moon.", encoding="utf-8")
    (corpus / "sub" / "bees.md").write_text("Bees dance.", encoding="utf-8")
    os.symlink(outside / "secret.txt", corpus / "link.txt")  # a file link out
    os.symlink(outside, corpus / "linked-dir")  # a folder link out
    os.symlink(corpus / "tides.txt", corpus / "sub" / "again.txt")  # a link that stays inside
    texts = {d.text for d in load_corpus(corpus)}
    assert "the server's private notes" not in texts
    assert {"Tides follow the Moon.", "Bees dance."} <= texts
    sources = {d.metadata["source"] for d in load_corpus(corpus)}
    assert sources == {"tides.txt", "sub/bees.md", "sub/again.txt"}
