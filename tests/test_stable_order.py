"""The ``stable`` document order: a document set keeps the layout its first question gave
it, so a new question over the set finds its document prefix (issue 44)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ragsnap.cache import open_store
from ragsnap.cache.tiers.orders import order_key
from ragsnap.compression import SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.prompt.assembly import PROMPT_TEMPLATE_VERSION
from ragsnap.runtime.generation import GenerationConfig
from tests.test_document_reuse import DOCS, _engine_loaded

FIRST, SECOND = "t5 t6 t7", "t12 t13 t9"
STABLE = AnswerOptions(
    press=SnapKVPress(budget=48, window=8),
    generation=GenerationConfig(max_new_tokens=4),
    document_order="stable",
)
RELEVANCE = dataclasses.replace(STABLE, document_order="relevance")


def ids(layout) -> list[str]:
    return [d.id for d in layout.documents]


@pytest.fixture
def engine(tmp_path) -> RagSnapEngine:
    return RagSnapEngine(_engine_loaded("llama"), store=open_store(f"file://{tmp_path}"))


def test_a_new_question_over_a_seen_set_is_laid_out_as_the_first_and_hits_its_prefix(
    engine, tmp_path
) -> None:
    first_order = ids(engine.prompt_of(FIRST, DOCS, RELEVANCE))
    assert ids(engine.prompt_of(SECOND, DOCS, RELEVANCE)) != first_order  # relevance re-orders
    assert engine.answer(FIRST, DOCS, STABLE).stats.cache == "miss"
    # the same set, listed in another order, asked something else: the first layout
    shuffled = [DOCS[2], DOCS[0], DOCS[3], DOCS[1]]
    assert ids(engine.prompt_of(SECOND, shuffled, STABLE)) == first_order
    stats = engine.answer(SECOND, shuffled, STABLE).stats
    assert (stats.cache, stats.cache_tier) == ("prefix-hit", "prefix")
    # the record is in the store: another replica (a new engine on it) replays it too
    replica = RagSnapEngine(_engine_loaded("llama"), store=open_store(f"file://{tmp_path}"))
    assert ids(replica.prompt_of(SECOND, DOCS, STABLE)) == first_order
    # under relevance the second question changes the prefix (what stable avoids): no
    # prefix hit, the per-document tier serves it
    assert engine.answer(SECOND, DOCS, RELEVANCE).stats.cache == "document-hit"


def test_a_set_is_recorded_per_namespace_and_per_set(engine) -> None:
    engine.prompt_of(FIRST, DOCS, STABLE, namespace="a")
    # another tenant's first question lays its copy of the set out by its own relevance
    assert ids(engine.prompt_of(SECOND, DOCS, STABLE, namespace="b")) == ids(
        engine.prompt_of(SECOND, DOCS, RELEVANCE)
    )
    # one document more is another set
    assert ids(engine.prompt_of(SECOND, DOCS[:3], STABLE, namespace="a")) == ids(
        engine.prompt_of(SECOND, DOCS[:3], RELEVANCE)
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        json.dumps({"order": []}).encode(),
        json.dumps(["0" * 64]).encode(),  # a document not in the set
        json.dumps([DOCS[0].content_hash, DOCS[0].content_hash]).encode(),  # twice
    ],
)
def test_a_damaged_or_forged_record_is_ignored(engine, payload) -> None:
    key = order_key("default", PROMPT_TEMPLATE_VERSION, DOCS)
    assert engine.tiers is not None
    engine.tiers.store.put(key, payload)
    assert ids(engine.prompt_of(SECOND, DOCS, STABLE)) == ids(
        engine.prompt_of(SECOND, DOCS, RELEVANCE)
    )
    assert engine.answer(SECOND, DOCS, STABLE).stats.cache == "miss"  # answered all the same


def test_a_record_of_part_of_the_set_puts_the_rest_after_it(engine) -> None:
    """A document the first prompt could not fit is not in its record: it goes last."""
    key = order_key("default", PROMPT_TEMPLATE_VERSION, DOCS)
    assert engine.tiers is not None
    engine.tiers.store.put(key, json.dumps([DOCS[3].content_hash, DOCS[1].content_hash]).encode())
    ordered = engine.tiers.orders.ordered(DOCS, PROMPT_TEMPLATE_VERSION, "default")
    assert ordered is not None
    assert [d.id for d in ordered] == ["d3", "d1", "d0", "d2"]
