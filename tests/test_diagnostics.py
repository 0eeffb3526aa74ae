"""The span-retention diagnostic on the embedded model."""

from __future__ import annotations

import pytest

from ragsnap.compression import make_press
from ragsnap.errors import InputError
from ragsnap.eval.diagnostics import diagnose, plot_retention
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig

FILLER = "The committee met again to discuss the budget of the village library. " * 40


@pytest.mark.model
def test_span_retention_is_one_with_the_full_cache_and_lower_when_compressed(
    engine, tmp_path
) -> None:
    text = FILLER + "The access code for the archive is 90417. " + FILLER
    docs = [Document(id="a", title="Minutes", text=text)]
    positions, (full, snap) = diagnose(
        engine.runtime,
        "What is the access code for the archive?",
        docs,
        "90417",
        [make_press("full"), make_press("snapkv", budget=64)],
    )
    assert len(positions) >= 2
    assert full.retention.shape == (30, 3) and bool((full.retention == 1).all())
    assert float(snap.retention.mean()) < 1.0
    plot_retention([full, snap], "90417", tmp_path / "heat.png")
    assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.model
def test_the_default_press_with_layers_of_different_lengths(engine) -> None:
    text = FILLER + "The access code for the archive is 90417. " + FILLER
    docs = [Document(id="a", title="Minutes", text=text)]
    press = make_press("ragsnap", budget=64)
    _, (default,) = diagnose(engine.runtime, "What is the access code?", docs, "90417", [press])
    layout = engine.build_prompt("q?", docs, GenerationConfig())
    prefill = engine.runtime.prefill(layout.input_ids, press)
    assert len(set(prefill.kept_tokens_per_layer)) > 1  # profiled budgets differ by layer
    assert default.retention.shape == (30, 3)
    assert 0.0 <= float(default.retention.min()) <= float(default.retention.max()) <= 1.0


@pytest.mark.model
def test_an_answer_missing_from_the_documents_is_a_clear_error(engine) -> None:
    docs = [Document(id="a", title="t", text="nothing here")]
    with pytest.raises(InputError, match="does not occur"):
        diagnose(engine.runtime, "q?", docs, "12345", [make_press("full")])
