"""Attribution on the embedded model: the sample documents, the default press."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragsnap.citations.options import CitationOptions
from ragsnap.compression import make_press
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import CitationsEvent, TokenEvent
from ragsnap.prompt.documents import load_documents
from ragsnap.runtime.generation import GenerationConfig

pytestmark = pytest.mark.model
SAMPLES = sorted((Path(__file__).parents[1] / "ragsnap" / "samples").glob("*.md"))


def test_embedded_answer_cites_the_rosetta_document_with_quotes(engine) -> None:
    documents = load_documents(SAMPLES)
    options = AnswerOptions(
        press=make_press("ragsnap", budget=128),
        generation=GenerationConfig(max_new_tokens=32),
        citations=CitationOptions(inline_markers=True),
    )
    events = list(engine.stream("Where is the Rosetta Stone kept?", documents, options))
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    cites = next(e for e in events if isinstance(e, CitationsEvent))
    by_id = {c.doc_id: c for c in cites.citations}
    rosetta = next(d for d in documents if "rosetta" in d.id.lower())
    assert rosetta.id in by_id
    citation = by_id[rosetta.id]
    assert citation.quotes and citation.supported is not False
    for quote in citation.quotes:
        assert rosetta.text[quote.start : quote.end] == quote.text
        assert quote.kept_share is not None and 0.0 <= quote.kept_share <= 1.0
    assert cites.answer_with_markers is not None and f"[{citation.index}]" in (
        cites.answer_with_markers
    )
    assert len(cites.answer_with_markers) > len(streamed)  # markers added, tokens untouched
