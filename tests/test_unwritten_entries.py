"""Compressed entries written after the answer, served from memory until then."""

from __future__ import annotations

import pytest
import torch

from ragsnap.cache import open_store
from ragsnap.cache.tiers.hit_memory import HitMemory
from ragsnap.cache.tiers.unwritten import UnwrittenEntries
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.engine.events import TokenEvent
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.test_scheduler import words
from tests.tiny_models import tiny_engine

DOCS = [
    Document(id="a", title="t2 t3", text=words(3, 60)),
    Document(id="b", title="t4", text=words(5, 60)),
]
QUESTION = "t7 t8 t9"


def test_held_bytes_stay_within_the_budget() -> None:
    entries = UnwrittenEntries(10)
    assert entries.hold("a", b"123456") and entries.nbytes == 6
    assert not entries.hold("b", b"12345")  # 11 bytes would not fit: the caller writes it
    assert entries.hold("a", b"1234567890") and entries.nbytes == 10  # replaces its own
    entries.written("a")
    assert entries.get("a") is None and entries.nbytes == 0 and len(entries) == 0
    entries.written("never held")  # nothing to forget: no error
    with pytest.raises(ValueError, match="max_bytes"):
        UnwrittenEntries(-1)


@pytest.fixture(scope="module")
def engine_tiny() -> RagSnapEngine:
    return tiny_engine("llama")


def _engine(engine_tiny, tmp_path, storage_dtype="auto") -> RagSnapEngine:
    store = open_store(f"file://{tmp_path}")
    # the entries counted here are the compressed and prefix ones: no per-document pieces,
    # and every prefix written (not only a recurring document set's)
    engine = RagSnapEngine(
        engine_tiny.loaded,
        store=store,
        storage_dtype=storage_dtype,
        document_cache=False,
        prefix_store="always",
    )
    engine.runtime.stop_ids.clear()
    return engine


def _stored(tmp_path) -> int:
    return sum(1 for _ in tmp_path.rglob("*.kv"))


def _options(tokens: int = 4) -> AnswerOptions:
    return AnswerOptions(generation=GenerationConfig(max_new_tokens=tokens), document_order="given")


@pytest.mark.parametrize("storage", ["auto", "bfloat16"])
def test_a_repeat_before_the_write_gets_what_the_store_gives_back(
    engine_tiny, tmp_path, storage
) -> None:
    engine = _engine(engine_tiny, tmp_path, storage)
    tiers, opts = engine.tiers, _options()
    tiers.hits = HitMemory(0)  # no loaded copy: the late hit reads the store
    layout = engine.prompt_of(QUESTION, DOCS, opts)
    _, report = engine.prefill(layout, opts.press, QUESTION, "ns")
    assert report.status == "miss" and report.bytes_written > 0  # counted as they queue
    counted = report.bytes_written
    assert _stored(tmp_path) == 0 and len(tiers.unwritten) == 1  # nothing written yet
    early, early_report = engine.prefill(layout, opts.press, QUESTION, "ns")
    assert early_report.status == "hit" and early.processed_tokens == 0
    tiers.finish(report)  # after the answer: the compressed and the prefix entries
    assert _stored(tmp_path) == 2 and len(tiers.unwritten) == 0
    assert report.bytes_written == counted  # not counted twice
    tiers.finish(report)  # nothing is written twice
    assert _stored(tmp_path) == 2
    late, late_report = engine.prefill(layout, opts.press, QUESTION, "ns")
    assert late_report.status == "hit" and late_report.bytes_read == early_report.bytes_read
    for a, b in zip(early.layers, late.layers, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(early.next_logits, late.next_logits)


def test_without_room_an_entry_is_written_before_the_answer(engine_tiny, tmp_path) -> None:
    engine = _engine(engine_tiny, tmp_path)
    engine.tiers.unwritten = UnwrittenEntries(0)
    opts = _options()
    layout = engine.prompt_of(QUESTION, DOCS, opts)
    _, report = engine.prefill(layout, opts.press, QUESTION, "ns")
    assert _stored(tmp_path) == 1 and report.bytes_written > 0  # the compressed entry
    assert len(report.pending) == 1  # the prefix entry still waits for the answer


def test_a_stream_closed_early_still_writes_its_entries(engine_tiny, tmp_path) -> None:
    engine = _engine(engine_tiny, tmp_path)
    stream = engine.stream(QUESTION, DOCS, _options(tokens=12), namespace="ns")
    assert any(isinstance(event, TokenEvent) for event in stream)  # reads up to a token
    assert _stored(tmp_path) == 0
    stream.close()
    assert _stored(tmp_path) == 2 and len(engine.tiers.unwritten) == 0
    again = list(engine.stream(QUESTION, DOCS, _options(tokens=12), namespace="ns"))
    assert again[-1].stats.cache == "hit"


def test_a_request_cancelled_while_decoding_still_writes_its_entries(engine_tiny, tmp_path) -> None:
    from ragsnap.engine.scheduler import Scheduler
    from tests.test_scheduler import Collector

    engine = _engine(engine_tiny, tmp_path)
    request = Collector(QUESTION, DOCS, _options(tokens=30), cancel_after=2)
    scheduler = Scheduler(engine, max_batch=4)
    scheduler.start()
    scheduler.submit(request)
    assert request.closed.wait(60) and request.outcome == "cancelled"
    scheduler.stop()
    assert _stored(tmp_path) == 2 and len(engine.tiers.unwritten) == 0
