"""RedisKVStore against a real redis-server: chunking, checksums, TTLs, namespaces, outages."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

pytest.importorskip("redis")

from ragsnap.cache import EntryKey, StoreUnavailable, open_store  # noqa: E402
from ragsnap.cache.backends.redis_store import RedisKVStore  # noqa: E402


def _key(namespace: str | None = None, digest: str | None = None) -> EntryKey:
    return EntryKey(namespace or uuid.uuid4().hex, "kv", digest or uuid.uuid4().hex * 2)


@pytest.fixture
def store(redis_server):
    with open_store(redis_server.url + "?chunk_bytes=1000&ttl=600&unsealed=1", key="") as opened:
        assert isinstance(opened, RedisKVStore)
        yield opened


def test_round_trip_is_bit_identical_across_chunks_with_ttl_on_every_part(store):
    key, payload = _key(), os.urandom(4321)  # 5 chunks of at most 1000 bytes
    assert store.put(key, payload)
    assert store.get(key) == payload
    names = sorted(store.client.scan_iter(match=f"ragsnap:v1:{key.namespace}:*"))
    assert len(names) == 6  # manifest + 5 chunks
    assert all(0 < store.client.ttl(name) <= 600 for name in names)


def test_missing_chunk_is_a_miss_and_the_entry_is_deleted(store):
    key = _key()
    store.put(key, os.urandom(2500))
    chunk = f"ragsnap:v1:{key.namespace}:kv:{{{key.digest}}}:chunk:1"
    assert store.client.delete(chunk) == 1  # what allkeys-lru eviction would do
    assert store.get(key) is None
    assert list(store.client.scan_iter(match=f"ragsnap:v1:{key.namespace}:*")) == []


def test_corrupted_byte_is_a_miss_and_the_entry_is_deleted(store):
    key = _key()
    store.put(key, b"x" * 2500)
    chunk = f"ragsnap:v1:{key.namespace}:kv:{{{key.digest}}}:chunk:2"
    store.client.setrange(chunk, 10, b"y")
    assert store.get(key) is None
    assert store.client.exists(f"ragsnap:v1:{key.namespace}:kv:{{{key.digest}}}:manifest") == 0


def test_namespaces_are_isolated_and_cleared_separately(store):
    digest = uuid.uuid4().hex * 2
    a, b = _key("tenant-a-" + digest[:8], digest), _key("tenant-b-" + digest[:8], digest)
    store.put(a, b"alpha")
    assert store.get(b) is None
    store.put(b, b"beta")
    assert (store.get(a), store.get(b)) == (b"alpha", b"beta")
    assert store.stats(a.namespace)["entries"] == 1
    assert store.clear(a.namespace) == 1
    assert (store.get(a), store.get(b)) == (None, b"beta")


def test_odd_namespaces_never_reach_the_key_space(store):
    key = _key("sk-secret key/with:colons*")
    store.put(key, b"data")
    names = [n.decode() for n in store.client.scan_iter(match="ragsnap:v1:*")]
    assert not any("secret" in n for n in names)
    assert store.get(key) == b"data"


def test_oom_on_write_is_refused_not_raised(redis_factory):
    server = redis_factory("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    with open_store(server.url + "?unsealed=1", key="") as small:
        assert small.put(_key(), os.urandom(32 * 2**20)) is False
        key = _key()
        assert small.put(key, b"small") is True
        assert small.get(key) == b"small"


def test_unreachable_server_reports_unavailable_then_recovers(redis_factory):
    server = redis_factory()
    store = RedisKVStore(server.url, backoff_s=0.0)
    key = _key()
    assert store.put(key, b"v1")
    server.stop()
    with pytest.raises(StoreUnavailable):
        store.get(key)
    assert store.stats()["state"] == "unavailable"
    server.start()  # same port, empty
    assert store.get(key) is None
    assert store.put(key, b"v2") and store.get(key) == b"v2"


def test_backoff_skips_the_server_until_it_expires(redis_factory):
    server = redis_factory()
    store = RedisKVStore(server.url, backoff_s=3600.0)
    server.stop()
    with pytest.raises(StoreUnavailable):
        store.get(_key())
    assert not store.available
    server.start()
    with pytest.raises(StoreUnavailable):  # still backing off: no connection attempt
        store.get(_key())


def test_exclusive_admits_one_holder_across_clients(redis_server):
    key, inside, peak = _key(), [0], [0]
    guard = threading.Lock()

    def work() -> None:
        with RedisKVStore(redis_server.url) as own:  # one client each, like separate processes
            with own.exclusive(key, wait_s=30):
                with guard:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                threading.Event().wait(0.05)
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1
    with RedisKVStore(redis_server.url) as check:
        assert check.client.exists(f"ragsnap:v1:{key.label}:kv:{{{key.digest}}}:lock") == 0
