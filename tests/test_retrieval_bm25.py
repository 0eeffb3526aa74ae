"""The built-in corpus chunking and BM25 retriever (no model needed)."""

from __future__ import annotations

import json

import pytest

from ragsnap.errors import InputError
from ragsnap.retrieval.bm25 import BM25Index
from ragsnap.retrieval.corpus import load_corpus, split_passages


@pytest.fixture()
def corpus(tmp_path):
    (tmp_path / "sea").mkdir()
    (tmp_path / "sea" / "tides.md").write_text(
        "# Tides\n\nThe Moon's gravity pulls the oceans and raises the tides.\n\n"
        "Spring tides happen when the Sun and the Moon line up."
    )
    (tmp_path / "bees.txt").write_text("Honeybees dance to tell the hive where flowers are.")
    records = [
        {
            "id": "pen",
            "title": "Penicillin",
            "text": "Fleming found penicillin in a mould in 1928.",
        },
        {
            "id": "rosetta",
            "title": "Rosetta",
            "text": "The Rosetta Stone has one decree in three scripts.",
        },
    ]
    (tmp_path / "more.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "ignored.csv").write_text("a,b\n1,2\n")
    return tmp_path


def test_split_passages_packs_paragraphs_within_the_word_limit():
    text = "one two three\n\nfour five\n\n\n" + " ".join(f"w{i}" for i in range(7))
    passages = split_passages(text, max_words=5)
    assert passages == ["one two three\n\nfour five", "w0 w1 w2 w3 w4", "w5 w6"]
    assert all(len(p.split()) <= 5 for p in passages)
    assert split_passages("  \n\n  ") == []


def test_corpus_passages_have_stable_ids(corpus):
    passages = load_corpus(corpus, max_words=12)
    ids = [p.id for p in passages]
    assert ids == ["bees.txt#1", "pen#1", "rosetta#1", "sea/tides.md#1", "sea/tides.md#2"]
    assert [p.id for p in load_corpus(corpus, max_words=12)] == ids  # same folder, same ids
    tides = passages[3]
    assert tides.title == "tides" and tides.metadata == {"source": "sea/tides.md", "chunk": 1}
    assert passages[1].title == "Penicillin" and passages[1].metadata["source"] == "more.jsonl"


def test_bm25_ranks_the_matching_passage_first(corpus):
    index = BM25Index.from_directory(corpus)
    hits = index.retrieve("who discovered penicillin", top_k=3)
    assert hits[0].id == "pen#1"
    assert hits[0].metadata["score"] > 0
    assert [h.id for h in index.retrieve("moon gravity tides", top_k=1)] == ["sea/tides.md#1"]
    assert index.retrieve("zebra quantum", top_k=3) == []  # no shared term, no passage
    assert len(index.retrieve("the moon and the hive", top_k=50)) <= len(index)


def test_bad_corpus_and_query_are_input_errors(corpus, tmp_path_factory):
    with pytest.raises(InputError, match="not found"):
        load_corpus(corpus / "missing")
    with pytest.raises(InputError, match="no .txt"):
        load_corpus(tmp_path_factory.mktemp("empty"))
    with pytest.raises(InputError) as info:
        BM25Index.from_directory(corpus).retrieve("  ")
    assert info.value.field == "query"
    (corpus / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(InputError, match="broken.jsonl:1"):
        load_corpus(corpus)


def test_ask_takes_documents_from_a_corpus(corpus):
    from ragsnap.cli import build_parser
    from ragsnap.cli.ask import gather_documents

    args = build_parser().parse_args(
        ["ask", "-q", "who discovered penicillin?", "--corpus", str(corpus), "--top-k", "2"]
    )
    documents = gather_documents(args)
    assert documents[0].id == "pen#1" and len(documents) <= 2
    args = build_parser().parse_args(["ask", "-q", "zebra quantum", "--corpus", str(corpus)])
    with pytest.raises(InputError, match="no passage"):
        gather_documents(args)
