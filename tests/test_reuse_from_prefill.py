"""Documents read once: a miss's reuse material is its own prefill's KV, written once.

A cold prompt's document prefix is stored with its answer and each document's piece is a
pointer into it, so no second pass computes pieces; a new question over the documents in the
same layout is a prefix hit in any process; in another order, a document hit cut from that
prefix; and a piece whose prefix is gone is a miss, never an error.
"""

from __future__ import annotations

import random

import pytest

from ragsnap.cache import open_store
from ragsnap.cache.serialization import KIND_DOCUMENT, KIND_PREFIX
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.runtime import blend
from tests.test_document_reuse import DOCS, OPTS, _engine_loaded

Q1, Q2, Q3 = "t5 t6 t7", "t8 t9", "t3 t4"


def _fresh_engine(loaded, url: str) -> RagSnapEngine:
    """A new engine on the store at ``url``: nothing in memory, as another process."""
    return RagSnapEngine(loaded, store=open_store(url), document_cache=True)


def _files(folder, kind: str) -> list:
    return sorted((folder / "default").glob(f"{kind}-*"))


def test_a_miss_computes_no_pieces_and_writes_its_documents_once(tmp_path, monkeypatch):
    def second_pass(*args, **kwargs):
        raise AssertionError("a piece was computed apart from the prompt's prefill")

    monkeypatch.setattr(blend, "document_pieces", second_pass)
    loaded = _engine_loaded("llama")
    eng = _fresh_engine(loaded, f"file://{tmp_path}")
    stats = eng.answer(Q1, DOCS[:3], OPTS).stats
    assert (stats.cache, stats.cache_tier) == ("miss", "cold")
    prefixes, pieces = _files(tmp_path, KIND_PREFIX), _files(tmp_path, KIND_DOCUMENT)
    assert len(prefixes) == 1 and len(pieces) == 3
    assert all(p.stat().st_size < 1024 for p in pieces)  # pointers, not KV
    compressed = _files(tmp_path, "kv")
    on_disk = sum(p.stat().st_size for p in prefixes + pieces + compressed)
    # what the answer says it wrote is what the store holds (the marker entries aside)
    assert abs(stats.cache_bytes_written - on_disk) < 0.02 * on_disk
    # the documents' KV is stored once: in the prefix entry
    kv_per_token = eng.kv_bytes_per_token()
    assert prefixes[0].stat().st_size < 1.05 * stats.prompt_tokens * kv_per_token


@pytest.mark.parametrize("store", ["file", "redis"])
def test_a_new_question_in_the_same_layout_is_a_prefix_hit_in_another_process(
    tmp_path, store, request
):
    if store == "redis":
        server = request.getfixturevalue("redis_server")
        url = server.url
    else:
        url = f"file://{tmp_path}"
    loaded = _engine_loaded("llama")
    namespace = f"ns{random.randrange(10**9)}"
    first = _fresh_engine(loaded, url)
    cold = list(first.stream(Q1, DOCS[:3], OPTS, namespace=namespace))[-1].stats
    assert cold.cache == "miss"
    second = _fresh_engine(loaded, url)
    again = list(second.stream(Q2, DOCS[:3], OPTS, namespace=namespace))[-1].stats
    assert (again.cache, again.cache_tier) == ("prefix-hit", "prefix")
    # only the tail (the question and enough of the documents' end for the window) ran
    assert again.prefill_tokens < again.prompt_tokens // 3
    assert again.cache_bytes_read > 0
    third = _fresh_engine(loaded, url)
    moved = list(third.stream(Q3, DOCS[:3][::-1], OPTS, namespace=namespace))[-1].stats
    assert (moved.cache_tier, moved.reused_documents) == ("documents", 3)


def test_a_piece_whose_prefix_is_gone_is_a_miss_and_the_request_is_served_cold(tmp_path):
    loaded = _engine_loaded("llama")
    url = f"file://{tmp_path}"
    _fresh_engine(loaded, url).answer(Q1, DOCS[:3], OPTS)
    for prefix in _files(tmp_path, KIND_PREFIX):
        prefix.unlink()  # evicted, or the store restarted empty
    eng = _fresh_engine(loaded, url)
    done = eng.answer(Q2, DOCS[:3][::-1], OPTS)
    assert (done.stats.cache, done.stats.cache_tier, done.stats.reused_documents) == (
        "miss",
        "cold",
        0,
    )
    assert done.answer is not None
    assert eng.store.rejections.get("stale") == 3  # the dangling pointers are dropped
    # the cold answer stored its own prefix: its documents are reusable again
    assert len(_files(tmp_path, KIND_PREFIX)) == 1 and len(_files(tmp_path, KIND_DOCUMENT)) == 3


def test_pieces_point_only_within_their_namespace(tmp_path):
    loaded = _engine_loaded("llama")
    eng = _fresh_engine(loaded, f"file://{tmp_path}")
    list(eng.stream(Q1, DOCS[:3], OPTS, namespace="tenant-a"))
    other = list(eng.stream(Q2, DOCS[:3][::-1], OPTS, namespace="tenant-b"))[-1].stats
    assert (other.cache, other.reused_documents) == ("miss", 0)
    same = list(eng.stream(Q2, DOCS[:3][::-1], OPTS, namespace="tenant-a"))[-1].stats
    assert (same.cache_tier, same.reused_documents) == ("documents", 3)
