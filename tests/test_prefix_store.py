"""When a document prefix reaches the store (issue 42): by default once its document set
recurs; seen once, it lives in this process's prefix memory only, so traffic of fresh
document sets writes no full-KV entries; ``prefix_store="always"`` writes every one."""

from __future__ import annotations

import pytest
import torch

from ragsnap.cache import open_store
from ragsnap.cache.report import CacheReport
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.test_scheduler import words
from tests.tiny_models import tiny_engine

DOCS = [Document(id="a", title="t3", text=words(5, 60)), Document(id="b", text=words(9, 60))]
OTHER = [Document(id="c", title="t5", text=words(20, 60)), Document(id="d", text=words(30, 60))]
OPTIONS = AnswerOptions(generation=GenerationConfig(max_new_tokens=2), document_order="given")


@pytest.fixture(scope="module")
def loaded():
    return tiny_engine("llama").loaded


def engine_on(loaded, folder, **settings) -> RagSnapEngine:
    store = open_store(f"file://{folder}")
    return RagSnapEngine(loaded, store=store, document_cache=False, **settings)


def ask(engine: RagSnapEngine, question: str, documents=DOCS) -> str:
    """Prefill ``question`` over ``documents`` through the tiers, write what it leaves;
    returns the cache status."""
    assert engine.tiers is not None
    layout = engine.prompt_of(question, documents, OPTIONS)
    _, report = engine.prefill(layout, OPTIONS.press, question, "ns")
    engine.tiers.finish(report)
    return report.status


def stored(folder, kind: str) -> int:
    """Entries of ``kind`` in the file store at ``folder`` (``kv``, ``prefix``, ``seen``)."""
    return sum(1 for _ in folder.rglob(f"{kind}-*.kv"))


def test_a_set_seen_once_stays_in_memory_and_is_written_when_it_recurs(loaded, tmp_path):
    engine = engine_on(loaded, tmp_path)
    assert ask(engine, words(40, 4)) == "miss"
    # the compressed entry and the set's marker: the prefix itself is in memory only
    assert (stored(tmp_path, "kv"), stored(tmp_path, "prefix"), stored(tmp_path, "seen")) == (
        1,
        0,
        1,
    )
    assert ask(engine, words(44, 4)) == "prefix-hit"  # a new question: from memory ...
    assert stored(tmp_path, "prefix") == 1  # ... and now the prefix entry is written
    # another process (a fresh engine on the same store) finds the prefix there
    assert ask(engine_on(loaded, tmp_path), words(48, 4)) == "prefix-hit"
    assert ask(engine, words(52, 4)) == "prefix-hit" and stored(tmp_path, "prefix") == 1


def test_a_set_another_process_saw_is_written_on_its_second_miss(loaded, tmp_path):
    assert ask(engine_on(loaded, tmp_path), words(40, 4)) == "miss"  # e.g. one `ragsnap ask`
    assert ask(engine_on(loaded, tmp_path), words(44, 4)) == "miss"  # the next one
    assert stored(tmp_path, "prefix") == 1
    assert ask(engine_on(loaded, tmp_path), words(48, 4)) == "prefix-hit"


def test_a_recurring_set_evicted_from_memory_is_computed_again_and_written(loaded, tmp_path):
    engine = engine_on(loaded, tmp_path)
    assert engine.tiers is not None
    ask(engine, words(40, 4))
    engine.tiers.memory.resize(0)  # evicted before it recurs
    assert ask(engine, words(44, 4)) == "miss" and stored(tmp_path, "prefix") == 1
    assert ask(engine_on(loaded, tmp_path), words(48, 4)) == "prefix-hit"


def test_always_writes_the_prefix_after_the_first_miss(loaded, tmp_path):
    ask(engine_on(loaded, tmp_path, prefix_store="always"), words(40, 4))
    assert stored(tmp_path, "prefix") == 1
    assert ask(engine_on(loaded, tmp_path), words(44, 4)) == "prefix-hit"


def test_a_prefix_larger_than_the_memory_is_written_at_once(loaded, tmp_path):
    engine = engine_on(loaded, tmp_path, prefix_memory_mb=0)
    ask(engine, words(40, 4))
    ask(engine, words(40, 4), OTHER)
    assert stored(tmp_path, "prefix") == 2  # no memory to keep them in: both are stored


def test_a_bad_setting_is_one_line_naming_it(loaded, tmp_path):
    from ragsnap.errors import ConfigError

    with pytest.raises(ConfigError, match="setting prefix_store: .*'recurring' or 'always'"):
        engine_on(loaded, tmp_path, prefix_store="sometimes")


def test_after_its_write_the_memory_holds_the_prefix_as_another_process_loads_it(loaded, tmp_path):
    engine = engine_on(loaded, tmp_path, prefix_store="always")
    assert engine.tiers is not None and engine.tiers.prefix_dtype is not None  # rounded
    layout = engine.prompt_of(words(40, 4), DOCS, OPTIONS)
    prompt = engine.executor.plan(layout, OPTIONS.press, words(40, 4), "ns")
    ask(engine, words(40, 4))
    held = engine.tiers.memory.get(prompt.plan.prefix_key)  # rounded as stored
    other = engine_on(loaded, tmp_path)
    assert other.tiers is not None
    report = CacheReport(status="miss")
    key = prompt.plan.prefix_key
    stored_layers = other.tiers.load_prefix_entry(key, layout.prefix_len, report)
    assert held is not None and stored_layers is not None and report.bytes_read > 0
    for (k, v), (sk, sv) in zip(held, stored_layers, strict=True):
        assert torch.equal(k, sk) and torch.equal(v, sv)
