"""Prompt assembly, document loading and citation parsing (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ragsnap.citations import cited_indices, document_keep_shares, extract_citations
from ragsnap.errors import InputError
from ragsnap.prompt.assembly import MIN_TRUNCATED_TOKENS, assemble_prompt, format_document
from ragsnap.prompt.documents import Document, load_documents
from tests.tiny_models import tiny_tokenizer

# -- prompt assembly (a real word-level tokenizer: one token per "tN" word) -------------


def words(start: int, count: int) -> str:
    return " ".join(f"t{start + i}" for i in range(count))


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_prompt_puts_documents_in_order_and_the_question_last(tokenizer) -> None:
    docs = [
        Document(id="a", title="t10", text=words(20, 40)),
        Document(id="b", title="t11", text=words(60, 30)),
    ]
    layout = assemble_prompt(tokenizer, words(90, 5), docs, max_prompt_tokens=1000)
    assert layout.documents == docs and not layout.dropped_doc_ids and not layout.truncated_doc_ids
    tokens = tokenizer.convert_ids_to_tokens(layout.input_ids)
    for (start, end), doc in zip(layout.doc_spans, docs, strict=True):
        # each span is exactly the document's text with its "[n] title" header
        assert tokens[start + 2 : end] == doc.text.split()
        assert tokens[start + 1] == doc.title
    assert layout.doc_spans[0][1] == layout.doc_spans[1][0]
    assert layout.prefix_len == layout.doc_spans[-1][1]
    tail = tokens[layout.prefix_len :]
    assert [t for t in tail if t != "<unk>"] == words(
        90, 5
    ).split()  # nothing but the question after the docs
    assert layout.num_tokens == len(layout.input_ids)


def test_prompt_drops_and_truncates_lowest_ranked_documents(tokenizer) -> None:
    docs = [
        Document(id="first", text=words(2, 60)),
        Document(id="second", text=words(2, 60)),
        Document(id="third", text=words(2, 60)),
    ]
    full = assemble_prompt(tokenizer, "t5", docs, max_prompt_tokens=10_000)
    overhead = full.num_tokens - sum(e - s for s, e in full.doc_spans)
    first_len = full.doc_spans[0][1] - full.doc_spans[0][0]
    # room for the first document and 40 tokens of the second
    limit = overhead + first_len + 40
    layout = assemble_prompt(tokenizer, "t5", docs, max_prompt_tokens=limit)
    assert layout.num_tokens == limit
    assert [d.id for d in layout.documents] == ["first", "second"]
    assert layout.truncated_doc_ids == ["second"]
    assert layout.dropped_doc_ids == ["third"]
    assert layout.doc_spans[1][1] - layout.doc_spans[1][0] == 40
    # too little room left for a useful piece: dropped rather than truncated
    tight = assemble_prompt(tokenizer, "t5", docs, max_prompt_tokens=overhead + first_len + 5)
    assert 5 < MIN_TRUNCATED_TOKENS
    assert tight.dropped_doc_ids == ["second", "third"] and tight.truncated_doc_ids == []


def test_prompt_rejects_empty_and_oversized_questions(tokenizer) -> None:
    docs = [Document(id="a", text="t3 t4")]
    with pytest.raises(InputError) as empty:
        assemble_prompt(tokenizer, "   ", docs, max_prompt_tokens=100)
    assert empty.value.field == "question"
    with pytest.raises(InputError, match="question is too long") as long:
        assemble_prompt(tokenizer, words(2, 80), docs, max_prompt_tokens=50)
    assert long.value.field == "question"


def test_format_document_numbers_and_titles() -> None:
    assert (
        format_document(3, Document(id="x", title="Tides", text=" The moon.  "))
        == "[3] Tides\nThe moon.\n\n"
    )
    assert format_document(1, Document(id="x", text="Body")).startswith("[1]\nBody")


# -- documents ---------------------------------------------------------------------------


def test_load_documents_from_text_markdown_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "tides.txt").write_text("The moon pulls the sea.\n", encoding="utf-8")
    (tmp_path / "bees.md").write_text("# Bees\nThey dance.", encoding="utf-8")
    records = [
        {"id": "p1", "title": "Penicillin", "text": "Fleming, 1928.", "year": 1928},
        {"title": "No id", "text": "Gets one from the file name and line."},
    ]
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text(
        json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n", encoding="utf-8"
    )
    docs = load_documents([tmp_path / "tides.txt", tmp_path / "bees.md", jsonl])
    assert [(d.id, d.title) for d in docs] == [
        ("tides", "tides"),
        ("bees", "bees"),
        ("p1", "Penicillin"),
        ("more-3", "No id"),
    ]
    assert docs[0].text == "The moon pulls the sea."
    assert docs[2].metadata == {"year": 1928}
    assert docs[0].content_hash != docs[1].content_hash
    assert (
        Document(id="other", text=docs[0].text, title="tides").content_hash == docs[0].content_hash
    )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "not found"),
        ("empty.txt", "  \n", "empty"),
        ("bad.jsonl", '{"text": "ok"}\n{not json}\n', "bad.jsonl:2: not valid JSON"),
        ("list.jsonl", "[1, 2]\n", "expected a JSON object"),
        ("notext.jsonl", '{"id": "a", "title": "t"}\n', "'text' must be a non-empty string"),
        ("badid.jsonl", '{"id": [1], "text": "x"}\n', "'id' must be"),
        ("doc.pdf", "%PDF", "unsupported document file type"),
        (
            "dups.jsonl",
            '{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n',
            "duplicate document ids: a",
        ),
    ],
)
def test_load_documents_rejects_bad_input(tmp_path: Path, name: str, content, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        load_documents([path])


def test_load_documents_rejects_binary(tmp_path: Path) -> None:
    path = tmp_path / "blob.txt"
    path.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(InputError, match="UTF-8"):
        load_documents([path])


# -- citations ---------------------------------------------------------------------------


def test_cited_indices_in_order_unique() -> None:
    answer = "Tides follow the moon [2]. Bees dance [1][3], as noted [2, 4] and [ 5 ] [x] [12345]."
    assert cited_indices(answer) == [2, 1, 3, 4]


def test_extract_citations_maps_to_documents_and_drops_unknown_numbers() -> None:
    docs = [Document(id="t", title="Tides", text="."), Document(id="b", title="Bees", text=".")]
    citations = extract_citations("See [2] and [7] and [1] and [0] and [2].", docs, [0.5, 0.25])
    assert [(c.index, c.doc_id, c.title, c.kept_share) for c in citations] == [
        (2, "b", "Bees", 0.25),
        (1, "t", "Tides", 0.5),
    ]
    as_dict = citations[0].to_dict()
    # the original keys keep their values; evidence fields are added (none for markers only)
    assert {k: as_dict[k] for k in ("index", "doc_id", "title", "kept_share")} == {
        "index": 2,
        "doc_id": "b",
        "title": "Bees",
        "kept_share": 0.25,
    }
    assert as_dict["source"] == "marker" and as_dict["supported"] is None
    assert as_dict["quotes"] == [] and as_dict["score"] is None
    assert extract_citations("[1]", docs)[0].kept_share is None
    assert extract_citations("no markers", docs) == []


def test_document_keep_shares_average_over_spans() -> None:
    rate = torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0, 0.25])
    assert document_keep_shares(rate, [(0, 2), (2, 5), (5, 5)]) == pytest.approx(
        [1.0, 0.5 / 3, 0.0]
    )


def test_a_huge_document_is_cut_before_tokenizing(tokenizer, monkeypatch) -> None:
    seen: list[int] = []
    real = type(tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        seen.append(len(text))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    huge = Document(id="huge", title="t3", text=words(2, 200_000))  # ~1.2 MB of text
    layout = assemble_prompt(tokenizer, "t5", [huge], max_prompt_tokens=300)
    assert layout.truncated_doc_ids == ["huge"] and layout.num_tokens == 300
    assert max(seen) < 300 * 40  # never the whole text
    small = assemble_prompt(
        tokenizer, "t5", [Document(id="s", text=words(2, 50))], max_prompt_tokens=300
    )
    assert small.truncated_doc_ids == []


# -- the relevance order ------------------------------------------------------------------


def test_relevance_lays_out_the_most_relevant_document_last_numbered_in_place(tokenizer) -> None:
    docs = [
        Document(id="a", title="t10", text=words(20, 30)),
        Document(id="b", title="t11", text=words(60, 30)),
        Document(id="c", title="t12", text=words(85, 8)),
    ]
    layout = assemble_prompt(
        tokenizer, "t5", docs, max_prompt_tokens=1000, relevance=[0.9, 0.1, 0.9]
    )
    # ascending; the tie between a and c goes to a, ranked higher, which comes later
    assert [d.id for d in layout.documents] == ["b", "c", "a"]
    given = assemble_prompt(tokenizer, "t5", docs, max_prompt_tokens=1000)
    assert [d.id for d in given.documents] == ["a", "b", "c"]
    assert sorted(layout.input_ids) == sorted(given.input_ids)  # the same tokens, moved
    tokens = tokenizer.convert_ids_to_tokens(layout.input_ids)
    for (start, end), doc in zip(layout.doc_spans, layout.documents, strict=True):
        assert tokens[start + 1] == doc.title and tokens[start + 2 : end] == doc.text.split()
    assert layout.prefix_len == layout.doc_spans[-1][1]
    assert layout.input_ids[layout.prefix_len :] == given.input_ids[given.prefix_len :]


def test_relevance_orders_only_what_fits_by_rank(tokenizer) -> None:
    docs = [Document(id=name, text=words(2, 60)) for name in ("first", "second", "third")]
    full = assemble_prompt(tokenizer, "t5", docs, max_prompt_tokens=10_000)
    overhead = full.num_tokens - sum(e - s for s, e in full.doc_spans)
    first_len = full.doc_spans[0][1] - full.doc_spans[0][0]
    limit = overhead + first_len + 40
    # the third is the most relevant, but ranked last: it is the one dropped
    layout = assemble_prompt(
        tokenizer, "t5", docs, max_prompt_tokens=limit, relevance=[0.5, 0.2, 1.0]
    )
    assert [d.id for d in layout.documents] == ["second", "first"]
    assert layout.dropped_doc_ids == ["third"] and layout.truncated_doc_ids == ["second"]
    assert layout.doc_spans[0][1] - layout.doc_spans[0][0] == 40  # cut as in rank order
    assert layout.num_tokens == limit


def test_relevance_needs_one_score_per_document(tokenizer) -> None:
    docs = [Document(id="a", text="t3"), Document(id="b", text="t4")]
    with pytest.raises(ValueError, match="1 relevance scores for 2 documents"):
        assemble_prompt(tokenizer, "t5", docs, max_prompt_tokens=100, relevance=[1.0])
