"""The engine with a KV store: hit == miss, prefix hits == cold runs, damage, outages,
single flight and namespaces, on the embedded model with a real redis-server."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
import torch
from safetensors.torch import load, save

from ragsnap.cache import open_store
from ragsnap.cache.backends.redis_store import RedisKVStore
from ragsnap.cache.serialization import read_metadata
from ragsnap.compression import H2OPress, SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.engine.events import DoneEvent
from ragsnap.prompt.documents import Document
from tests.redis_server import free_port

pytestmark = pytest.mark.model

DOCS = [
    Document(
        id="tides",
        title="Tides",
        text="Tides are caused mainly by the gravity of the Moon "
        "pulling on the oceans. The Sun adds a smaller pull, so spring tides are highest.",
    ),
    Document(
        id="bees",
        title="Honeybees",
        text="Honeybees tell each other where flowers are by "
        "dancing in the hive. The waggle dance gives the direction and distance to food.",
    ),
]
Q1, Q2 = "What causes tides?", "How do honeybees tell each other where flowers are?"


def options(window: int = 8, budget: int = 48, press=None, tokens: int = 6) -> AnswerOptions:
    from ragsnap.runtime.generation import GenerationConfig

    return AnswerOptions(
        press=press or SnapKVPress(budget=budget, window=window),
        generation=GenerationConfig(max_new_tokens=tokens),
        document_order="given",  # one document prefix for both questions
    )


def ask(
    eng: RagSnapEngine, question: str, namespace: str, opts: AnswerOptions | None = None
) -> DoneEvent:
    events = list(eng.stream(question, DOCS, opts or options(), namespace=namespace))
    assert events[0].cache == events[-1].stats.cache  # meta and stats agree
    return events[-1]


def counting(eng: RagSnapEngine) -> list[int]:
    """Count the engine's prefills (the real method still runs)."""
    calls: list[int] = []
    real, real_tails = eng.runtime.prefill_steps, eng.runtime.prefill_tails_steps

    def prefill_steps(input_ids, press, **kwargs):
        calls.append(len(input_ids) - kwargs.get("start", 0))
        return real(input_ids, press, **kwargs)

    def prefill_tails_steps(tails):  # prefill_tails drains it
        calls.extend(len(t.input_ids) - t.start for t in tails)
        return real_tails(tails)

    eng.runtime.prefill_steps = prefill_steps  # type: ignore[method-assign]
    eng.runtime.prefill_tails_steps = prefill_tails_steps  # type: ignore[method-assign]
    return calls


@pytest.fixture(scope="module")
def cold(engine):
    """Answers of the engine without any store, per (question, window, budget)."""
    memo: dict[tuple[str, int, int], str] = {}

    def answer(question: str, window: int = 8, budget: int = 48) -> str:
        if (question, window, budget) not in memo:
            memo[(question, window, budget)] = engine.answer(
                question, DOCS, options(window, budget)
            ).answer
        return memo[(question, window, budget)]

    return answer


@pytest.fixture
def ns() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def redis_engine(engine, url: str, **kwargs) -> RagSnapEngine:
    return RagSnapEngine(engine.loaded, store=open_store(url), **kwargs)


def test_hit_loads_bit_identical_kv_and_answers_exactly_as_the_miss(engine, redis_server, ns, cold):
    eng = redis_engine(engine, redis_server.url, hit_memory_mb=0)  # every hit reads Redis
    layout = eng.build_prompt(Q1, DOCS, options().generation, order="given")
    press = options().press
    missed, miss_report = eng.prefill(layout, press, Q1, ns)
    assert miss_report.status == "miss" and miss_report.pending  # written after the answer
    eng.tiers.finish(miss_report)
    assert miss_report.bytes_written > 0
    hit, report = eng.prefill(layout, press, Q1, ns)
    assert report.status == "hit" and report.bytes_read > 0 and hit.processed_tokens == 0
    for a, b in zip(missed.cache.layers, hit.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    for a, b in zip(missed.kept, hit.kept, strict=True):
        assert torch.equal(a.indices, b.indices)
    assert torch.equal(missed.next_logits, hit.next_logits)

    first, second = ask(eng, Q1, ns + "-x"), ask(eng, Q1, ns + "-x")
    assert (first.stats.cache, second.stats.cache) == ("miss", "hit")
    assert second.answer == first.answer == cold(Q1)
    assert second.stats.prefill_tokens == 0 and second.stats.cache_bytes_read > 0
    assert first.stats.cache_bytes_written > second.stats.cache_bytes_written == 0
    assert [c.doc_id for c in second.citations] == [c.doc_id for c in first.citations]


@pytest.mark.parametrize("damage", ["evicted_chunk", "corrupted_byte", "stale_version"])
def test_damaged_entry_is_a_miss_cleaned_up_and_recomputed(
    engine, redis_server, ns, damage, caplog
):
    store = RedisKVStore.from_url(redis_server.url + "?chunk_bytes=65536")
    # the exact tier alone: neither the prefix nor the per-document tier nor a loaded copy
    # may serve the retry
    eng = RagSnapEngine(
        engine.loaded, store=store, prefix_cache=False, document_cache=False, hit_memory_mb=0
    )
    first = ask(eng, Q1, ns)
    key = eng.tiers.entry_keys(
        eng.build_prompt(Q1, DOCS, options().generation, order="given"),
        options().press.config(),
        Q1,
        ns,
    )[0]
    base = f"ragsnap:v1:{key.label}:kv:{{{key.digest}}}"
    if damage == "evicted_chunk":
        assert store.client.delete(f"{base}:chunk:3") == 1
    elif damage == "corrupted_byte":
        store.client.setrange(f"{base}:chunk:2", 100, b"\x00\x01")
    else:
        payload = store.get(key)
        store.put(
            key, save(load(payload), metadata={**read_metadata(payload), "format_version": "0"})
        )
    calls = counting(eng)
    with caplog.at_level(logging.WARNING, logger="ragsnap.cache"):
        again = ask(eng, Q1, ns)
    assert again.stats.cache == "miss" and len(calls) == 1
    assert again.answer == first.answer
    assert any(word in caplog.text for word in ("lost a chunk", "checksum", "format version"))
    assert ask(eng, Q1, ns).stats.cache == "hit"  # stored again, whole


def test_redis_killed_between_requests_then_restarted(engine, redis_factory, ns, cold):
    server = redis_factory()
    eng = RagSnapEngine(engine.loaded, store=RedisKVStore(server.url, backoff_s=0.0))
    assert ask(eng, Q1, ns).stats.cache == "miss"
    server.stop()
    kept = ask(eng, Q1, ns)  # the entry outlived Redis in this process's memory
    assert kept.stats.cache == "hit" and kept.answer == cold(Q1)
    down = ask(eng, Q2, ns)
    assert down.stats.cache == "unavailable" and down.answer == cold(Q2)
    assert down.stats.cache_bytes_written == 0
    server.start()  # the same port, empty
    # the documents' prefix outlived Redis in this process's memory: only the tail runs
    assert ask(eng, Q2, ns).stats.cache == "prefix-hit"
    assert ask(eng, Q2, ns).stats.cache == "hit"


def test_unreachable_at_start_still_answers(engine, ns, cold):
    eng = redis_engine(engine, f"redis://127.0.0.1:{free_port()}/0")
    done = ask(eng, Q1, ns)
    assert done.stats.cache == "unavailable" and done.answer == cold(Q1)


def test_refused_write_still_answers(engine, redis_factory, ns, cold):
    server = redis_factory("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    eng = redis_engine(engine, server.url, prefix_cache=False)
    first, second = ask(eng, Q1, ns), ask(eng, Q1, ns)
    assert first.answer == second.answer == cold(Q1)
    # the entry was serialized and handed to the store (counted), which refused it
    assert first.stats.cache_bytes_written > 0 and second.stats.cache == "miss"


@pytest.mark.parametrize("backend", ["redis", "file"])
def test_eight_concurrent_identical_requests_prefill_once(
    engine, redis_server, tmp_path, ns, backend
):
    url = redis_server.url if backend == "redis" else f"file://{tmp_path}"
    eng = redis_engine(engine, url)
    calls = counting(eng)
    barrier = threading.Barrier(8)
    results: list[DoneEvent | BaseException] = []

    def request() -> None:
        try:
            barrier.wait()
            results.append(ask(eng, Q1, ns, options(tokens=3)))
        except BaseException as exc:  # surfaced below
            results.append(exc)

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(isinstance(r, DoneEvent) for r in results), results
    assert len(calls) == 1, str(sorted(r.stats.cache for r in results))
    assert sorted(r.stats.cache for r in results) == ["hit"] * 7 + ["miss"]
    assert len({r.answer for r in results}) == 1


@pytest.mark.parametrize("memory", [0, 1024], ids=["from-the-store", "from-memory"])
def test_prefix_hit_prefills_only_the_tail_and_matches_a_cold_run(
    engine, redis_server, ns, cold, memory
):
    eng = redis_engine(engine, redis_server.url, prefix_memory_mb=memory)
    assert ask(eng, Q1, ns).stats.cache == "miss"  # stores the documents' prefix
    calls = counting(eng)
    done = ask(eng, Q2, ns)
    layout = eng.build_prompt(Q2, DOCS, options().generation, order="given")
    tail = layout.num_tokens - layout.prefix_len
    assert tail > 8  # longer than the window: the forward covers exactly the tail
    assert done.stats.cache == "prefix-hit"
    assert calls == [tail] and done.stats.prefill_tokens == tail
    # the prefix came from this process's memory (no bytes read) or from Redis
    assert (done.stats.cache_bytes_read == 0) == bool(memory)
    assert done.answer == cold(Q2)
    assert ask(eng, Q2, ns).stats.cache == "hit"


@pytest.mark.parametrize("storage", ["auto", "bfloat16"])
def test_a_prefix_from_memory_is_the_prefix_the_store_gives_back(engine, tmp_path, ns, storage):
    """Two engines on one store, as two processes: the one that computed the prefix keeps
    it in memory, the other reads it from the store (then keeps it); both answer alike, also
    when the store keeps KV in a smaller dtype (memory keeps it rounded the same way)."""
    store = open_store(f"file://{tmp_path}")
    first = RagSnapEngine(engine.loaded, store=store, storage_dtype=storage)
    second = RagSnapEngine(engine.loaded, store=store, storage_dtype=storage)
    opts = options(tokens=8)
    assert ask(first, Q1, ns, opts).stats.cache == "miss"
    mine, other = ask(first, Q2, ns, opts), ask(second, Q2 + " Briefly.", ns, opts)
    assert (mine.stats.cache, other.stats.cache) == ("prefix-hit", "prefix-hit")
    assert mine.stats.cache_bytes_read == 0 < other.stats.cache_bytes_read
    assert len(second.tiers.memory) == 1  # now kept by the second process too
    layout = first.build_prompt(Q2, DOCS, opts.generation, order="given")
    pkey = first.tiers.entry_keys(layout, opts.press.config(), Q2, ns)[1]
    kept, loaded = first.tiers.memory.get(pkey), second.tiers.memory.get(pkey)
    for (k1, v1), (k2, v2) in zip(kept, loaded, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert ask(second, Q2, ns, opts).answer == mine.answer


def test_prefix_hit_with_a_window_longer_than_the_tail_crops_the_prefix(
    engine, redis_server, ns, cold
):
    eng = redis_engine(engine, redis_server.url)
    opts = options(window=40, budget=64)
    ask(eng, Q1, ns, opts)
    done = ask(eng, Q2, ns, opts)
    layout = eng.build_prompt(Q2, DOCS, opts.generation, order="given")
    assert layout.num_tokens - layout.prefix_len < 40
    assert done.stats.cache == "prefix-hit" and done.stats.prefill_tokens == 40
    assert done.answer == cold(Q2, window=40, budget=64)


def test_presses_that_vote_with_every_query_do_not_reuse_prefixes(engine, redis_server, ns):
    eng = redis_engine(engine, redis_server.url)
    opts = options(press=H2OPress(budget=48, window=8), tokens=2)
    ask(eng, Q1, ns, opts)
    done = ask(eng, Q2, ns, opts)  # H2O scores with every prompt query: a tail alone would differ
    assert done.stats.cache == "miss"
    assert done.stats.prefill_tokens == done.stats.prompt_tokens


def test_namespaces_never_see_each_other(engine, redis_server, ns):
    eng = redis_engine(engine, redis_server.url)
    assert ask(eng, Q1, ns + "-a").stats.cache == "miss"
    assert ask(eng, Q1, ns + "-b").stats.cache == "miss"  # neither tier crosses over
    assert ask(eng, Q1, ns + "-a").stats.cache == "hit"


def test_no_store_means_cache_off(engine, ns):
    eng = RagSnapEngine(engine.loaded, store=open_store("none"))
    assert ask(eng, Q1, ns).stats.cache == "off"


def test_the_default_press_is_cached_and_reuses_prefixes(engine, redis_server, ns):
    """The default press (word completion + Attention Matching over SnapKV) carries a
    decode bias: it must survive the store, and its window must drive the prefix crop."""
    from ragsnap.compression import make_press

    opts = options(press=make_press(budget=48), tokens=4)  # the default window (32) > the tail
    eng = redis_engine(engine, redis_server.url)
    first, again = ask(eng, Q1, ns, opts), ask(eng, Q1, ns, opts)
    assert (first.stats.cache, again.stats.cache) == ("miss", "hit")
    assert again.answer == first.answer
    reused = ask(eng, Q2, ns, opts)
    assert reused.stats.cache == "prefix-hit"
    assert reused.answer == engine.answer(Q2, DOCS, opts).answer


def test_an_exact_hit_brings_back_the_draft_that_speeds_its_decode(engine, redis_server, ns):
    from ragsnap.compression import make_press

    opts = options(press=make_press(budget=48))  # the default press drafts 8 tokens
    eng = redis_engine(engine, redis_server.url, speculate=8)
    layout = eng.build_prompt(Q1, DOCS, opts.generation, order="given")
    missed, _ = eng.prefill(layout, opts.press, Q1, ns)
    hit, report = eng.prefill(layout, opts.press, Q1, ns)
    assert report.status == "hit" and hit.draft == missed.draft and missed.draft
    first, again = ask(eng, Q1, ns + "-x", opts), ask(eng, Q1, ns + "-x", opts)
    assert (first.stats.cache, again.stats.cache) == ("miss", "hit")
    assert again.answer == first.answer
    assert again.stats.drafts_kept == first.stats.drafts_kept > 0
