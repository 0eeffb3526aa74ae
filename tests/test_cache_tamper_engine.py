"""A tampered cache entry (valid checksum; changed bytes, metadata or dtype) is a miss,
deleted, counted, and the answer equals the cold one: on the embedded model, with a real
redis-server and the file store, with and without a cache key."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ragsnap.cache import EntryKey, open_store
from ragsnap.cache.backends.file_store import MAGIC, FileKVStore
from ragsnap.cache.backends.sealed import SealedKVStore
from ragsnap.engine.engine import RagSnapEngine
from tests.test_cache_engine import Q1, ask
from tests.test_cache_hostile import _with_metadata, _with_tensor

pytestmark = pytest.mark.model


def _backend(store):
    return store.inner if isinstance(store, SealedKVStore) else store


def _raw_entries(store, ns: str) -> list[tuple[Callable[[bytes], None], bytes]]:
    """(write-back, raw backend payload) of each compressed entry of namespace ``ns``; the
    write-back stores new bytes with a checksum that matches them."""
    inner = _backend(store)
    out: list[tuple[Callable[[bytes], None], bytes]] = []
    if isinstance(inner, FileKVStore):
        for path in (inner.root / ns).glob("kv-*.kv"):

            def write(new: bytes, path: Path = path) -> None:
                path.write_bytes(MAGIC + hashlib.sha256(new).digest() + new)

            out.append((write, path.read_bytes()[len(MAGIC) + 32 :]))
        return out
    for name in inner.client.scan_iter(match=f"ragsnap:v1:{ns}:kv:*:manifest"):
        key = EntryKey(ns, "kv", name.decode().split("{")[1].split("}")[0])

        def put(new: bytes, key: EntryKey = key) -> None:
            inner.put(key, new)

        out.append((put, inner.get(key)))
    return out


def _flip(data: bytes) -> bytes:
    forged = bytearray(data)
    forged[len(forged) // 2] ^= 0x01
    return bytes(forged)


CASES = {
    # unsealed (?unsealed=1), the payload's own consistency checks catch a forged dtype / layout
    "file, dtype": ("file", None, lambda d: _with_metadata(d, dtype="bfloat16")),
    "file, storage dtype": ("file", None, lambda d: _with_metadata(d, storage_dtype="float16")),
    "redis, num_layers": ("redis", None, lambda d: _with_metadata(d, num_layers="3")),
    "redis, logits": (
        "redis",
        None,
        lambda d: _with_tensor(d, "logits", torch.zeros(2, 2)),
    ),
    # with a key every change is caught, even one that keeps the payload consistent
    "file+key, bytes": ("file", "s3cret", _flip),
    "redis+key, bytes": ("redis", "s3cret", _flip),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tampered_entry_is_a_miss_deleted_and_the_answer_is_the_cold_one(
    engine, redis_server, tmp_path, case
):
    backend, secret, forge = CASES[case]
    url = f"file://{tmp_path}" if backend == "file" else redis_server.url
    store = open_store(url, key=secret) if secret else open_store(f"{url}?unsealed=1", key="")
    ns = uuid.uuid4().hex[:12]
    # the store alone: no prefix tiers, and no copy of the entry kept loaded in memory
    eng = RagSnapEngine(
        engine.loaded, store=store, prefix_cache=False, document_cache=False, hit_memory_mb=0
    )
    cold = ask(eng, Q1, ns)
    assert cold.stats.cache == "miss"
    entries = _raw_entries(store, ns)
    assert len(entries) == 1
    write, data = entries[0]
    write(forge(data))
    again = ask(eng, Q1, ns)
    assert again.stats.cache == "miss"  # recomputed, not answered from the forgery
    assert again.answer == cold.answer
    assert sum(store.rejections.values()) == 1
    hit = ask(eng, Q1, ns)
    assert hit.stats.cache == "hit"  # the recomputed entry replaced the forgery
    assert hit.answer == cold.answer
    store.close()


def test_a_miss_with_the_prefix_tier_counts_the_document_prefix_pass(engine, tmp_path):
    """The prefix is prefilled in its own pass on a miss: its tokens and its time are part
    of ``prefill_tokens`` and ``prefill_s``."""
    eng = RagSnapEngine(engine.loaded, store=open_store(f"file://{tmp_path}"))
    assert eng.tiers is not None
    passes: list[float] = []
    real = eng.runtime.prefill_full_steps

    def timed(prefix_ids, chunk=None):
        started = time.perf_counter()
        try:
            return (yield from real(prefix_ids, chunk))
        finally:
            passes.append(time.perf_counter() - started)

    eng.runtime.prefill_full_steps = timed  # type: ignore[method-assign]
    done = ask(eng, Q1, uuid.uuid4().hex[:12])
    assert done.stats.cache == "miss" and len(passes) == 1
    assert done.stats.prefill_tokens == done.stats.prompt_tokens
    assert done.stats.prefill_s >= round(passes[0], 4) - 1e-4
