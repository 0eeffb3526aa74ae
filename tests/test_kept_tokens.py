"""Kept-token maps: prompt positions mapped back to each document's characters (the
embedded model's tokenizer; no forward pass)."""

from __future__ import annotations

import pytest
import torch

from ragsnap.citations.kept import document_kept_tokens
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.documents import Document

pytestmark = pytest.mark.model


def test_each_span_is_the_token_at_its_prompt_position(engine):
    tokenizer = engine.tokenizer
    docs = [
        Document(id="a", title="Alpha", text="  Leading spaces, then words.\n"),
        Document(id="b", title="", text="No title here; ünïcode and emoji 🐝 too."),
    ]
    layout = assemble_prompt(tokenizer, "Which?", docs, max_prompt_tokens=2048)
    rate = torch.arange(layout.num_tokens, dtype=torch.float) / layout.num_tokens
    maps = document_kept_tokens(tokenizer, layout.documents, layout.doc_spans, rate)
    for doc, kept, (begin, end) in zip(docs, maps, layout.doc_spans, strict=True):
        assert kept.doc_id == doc.id
        # shares rise with the position: the spans map to distinct, ordered positions
        positions = [round(s.share * layout.num_tokens) for s in kept.spans]
        assert positions == sorted(positions) and begin <= positions[0] and positions[-1] < end
        for span in kept.spans:
            piece = doc.text[span.start : span.end]
            token = tokenizer.decode(layout.input_ids[round(span.share * layout.num_tokens)])
            assert piece.strip() == token.strip() or "\ufffd" in token  # a split emoji
        # the spans cover every visible character (byte tokens of one character overlap)
        covered = {i for s in kept.spans for i in range(s.start, s.end)}
        assert {i for i, c in enumerate(doc.text) if not c.isspace()} <= covered
        assert [s.start for s in kept.spans] == sorted(s.start for s in kept.spans)


def test_a_truncated_document_maps_only_its_prompt_tokens(engine):
    long = Document(id="long", text=" ".join(f"word{i}" for i in range(600)))
    layout = assemble_prompt(engine.tokenizer, "Which?", [long], max_prompt_tokens=200)
    assert layout.truncated_doc_ids == ["long"]
    (kept,) = document_kept_tokens(
        engine.tokenizer, layout.documents, layout.doc_spans, torch.ones(layout.num_tokens)
    )
    begin, end = layout.doc_spans[0]
    assert 0 < len(kept.spans) <= end - begin
    assert kept.spans[-1].end < len(long.text) // 2 and kept.kept_share == 1.0
