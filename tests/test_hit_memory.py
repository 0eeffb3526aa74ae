"""The in-memory tier of compressed entries: filled by store reads and by this process's
own writes, answering exactly as the store does, within its byte budget."""

from __future__ import annotations

import torch

from ragsnap.cache import open_store
from ragsnap.cache.tiers.hit_memory import HitMemory, stored_nbytes
from ragsnap.compression import SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import tiny_engine

DOCS = [Document(id="d", title="t", text=" ".join(f"w{i}" for i in range(90)))]
QUESTION = "q1 q2 q3 q4"
OPTIONS = AnswerOptions(SnapKVPress(budget=24, window=8), GenerationConfig(max_new_tokens=5))


def ask(engine: RagSnapEngine, namespace: str = "t"):
    return [e for e in engine.stream(QUESTION, DOCS, OPTIONS, namespace=namespace)][-1]


def entry_key(engine: RagSnapEngine, namespace: str = "t"):
    layout = engine.build_prompt(QUESTION, DOCS, OPTIONS.generation)
    return engine.tiers.entry_keys(layout, OPTIONS.press.config(), QUESTION, namespace)[0]


def test_a_written_entry_is_served_from_memory_as_the_store_serves_it(tmp_path) -> None:
    loaded = tiny_engine("llama").loaded
    store = open_store(f"file://{tmp_path}")
    writer = RagSnapEngine(loaded, store=store)  # two engines on one store: two processes
    reader = RagSnapEngine(loaded, store=store)
    miss = ask(writer)
    key = entry_key(writer)
    assert miss.stats.cache == "miss" and writer.tiers.hits.get(key) is not None
    assert store.get(key) is not None  # written, and kept loaded by the writer

    mine, other = ask(writer), ask(reader)
    assert (mine.stats.cache, other.stats.cache) == ("hit", "hit")
    assert mine.stats.cache_bytes_read == 0 < other.stats.cache_bytes_read  # memory / store
    again = ask(reader)
    assert again.stats.cache == "hit" and again.stats.cache_bytes_read == 0  # now kept too
    assert mine.answer == other.answer == again.answer == miss.answer
    a, b = writer.tiers.hits.get(key), reader.tiers.hits.get(key)
    for (k1, v1), (k2, v2) in zip(a.layers, b.layers, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(a.next_logits, b.next_logits) and a.draft == b.draft


def test_namespaces_stay_apart_and_a_zero_budget_reads_the_store_each_time(tmp_path) -> None:
    loaded = tiny_engine("llama").loaded
    store = open_store(f"file://{tmp_path}")
    engine = RagSnapEngine(loaded, store=store)
    ask(engine, "a")
    assert ask(engine, "b").stats.cache == "miss"  # tenant a's entry is not b's
    off = RagSnapEngine(loaded, store=store, hit_memory_mb=0)
    reads = [ask(off, "a").stats.cache_bytes_read for _ in range(2)]
    assert reads[0] == reads[1] > 0 and len(off.tiers.hits) == 0


def test_entries_leave_least_recently_used_first_within_the_budget(tmp_path) -> None:
    loaded = tiny_engine("llama").loaded
    engine = RagSnapEngine(loaded, store=open_store(f"file://{tmp_path}"))
    for namespace in "abc":
        ask(engine, namespace)
    stored = [engine.tiers.hits.get(entry_key(engine, n)) for n in "abc"]
    size = stored_nbytes(stored[0])
    # the kept layers share the cache layers' tensors: counted once
    assert size < sum(k.nbytes + v.nbytes for k, v in stored[0].layers) * 2
    memory = HitMemory(2 * size)
    for name, entry in zip("abc", stored, strict=True):
        memory.get("a")  # a stays recent: b leaves when c comes
        assert memory.put(name, entry)
    assert memory.get("b") is None and memory.get("a") is stored[0]
    assert memory.get("c") is stored[2] and memory.nbytes == 2 * size
    assert not HitMemory(size - 1).put("a", stored[0])
