"""FileKVStore: round trips, damage, the size cap (least recently used first), two processes."""

from __future__ import annotations

import multiprocessing
import os
import uuid

from ragsnap.cache import EntryKey, open_store
from ragsnap.cache.backends.file_store import FileKVStore


def _key(namespace: str = "default", n: int | None = None) -> EntryKey:
    digest = f"{n:064x}" if n is not None else uuid.uuid4().hex * 2
    return EntryKey(namespace, "kv", digest)


def test_round_trip_and_damage(tmp_path):
    store = open_store(f"file://{tmp_path}?max_bytes=1MB&unsealed=1", key="")
    assert isinstance(store, FileKVStore) and store.max_bytes == 2**20
    key, payload = _key(), os.urandom(5000)
    assert store.put(key, payload)
    assert store.get(key) == payload
    path = next((tmp_path / "default").glob("*.kv"))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(key) is None
    assert not path.exists()


def test_size_cap_evicts_least_recently_used(tmp_path):
    store = FileKVStore(tmp_path, max_bytes=3500)
    keys = [_key(n=i) for i in range(3)]
    for i, key in enumerate(keys):
        store.put(key, bytes([i]) * 1000)
        path = store._path(key)
        os.utime(path, (1000 + i, 1000 + i))  # explicit ages: 0 oldest
    assert store.get(keys[0]) is not None  # a read makes 0 the most recent
    store.put(_key(n=99), b"z" * 1000)  # over the cap: 1 is now the least recently used
    assert store.get(keys[1]) is None
    assert store.get(keys[0]) is not None and store.get(keys[2]) is not None
    assert store.stats()["bytes"] <= 3500


def test_entry_larger_than_the_cap_is_refused(tmp_path):
    store = FileKVStore(tmp_path, max_bytes=100)
    assert store.put(_key(), b"x" * 500) is False
    assert store.stats()["entries"] == 0


def test_unwritable_directory_is_logged_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = FileKVStore(blocker / "kv")
    assert store.put(_key(), b"data") is False
    assert store.get(_key()) is None


def test_namespaces_are_isolated_and_cleared_separately(tmp_path):
    store = FileKVStore(tmp_path)
    a, b = _key("a", 1), _key("b", 1)
    store.put(a, b"alpha")
    assert store.get(b) is None
    store.put(b, b"beta")
    assert store.clear("a") == 1
    assert (store.get(a), store.get(b)) == (None, b"beta")
    assert store.stats()["entries"] == 1


def _hammer(root: str, worker: int, rounds: int, queue) -> None:  # type: ignore[no-untyped-def]
    store = FileKVStore(root, max_bytes=40_000)
    bad = 0
    for r in range(rounds):
        n = (r * 7 + worker) % 12
        key = _key(n=n)
        payload = bytes([n]) * (2000 + 100 * n)
        got = store.get(key)
        if got is not None and got != payload:
            bad += 1
        store.put(key, payload)
    queue.put(bad)


def test_two_processes_share_one_directory(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), w, 150, queue)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert [queue.get(timeout=5), queue.get(timeout=5)] == [0, 0]  # never a torn or wrong read
    store = FileKVStore(tmp_path, max_bytes=40_000)
    assert store.stats()["bytes"] <= 40_000
    assert not list(tmp_path.rglob("*.tmp"))


def test_holding_several_keys_of_one_lock_stripe_does_not_wait_on_itself(tmp_path):
    """Entry locks are striped by the digest's first byte: a group of prefix hits whose
    keys share a stripe once waited out the whole lock timeout on its own lock."""
    import threading
    import time

    store = FileKVStore(tmp_path)
    same_stripe = [
        EntryKey("default", "kv", ("abcdef01" + uuid.uuid4().hex * 2)[:64]) for _ in range(3)
    ]
    started = time.monotonic()
    with store.exclusive_many([*same_stripe, same_stripe[0]], wait_s=30):
        held = time.monotonic() - started
        # another thread still waits for the stripe, whichever of its keys it asks for
        entered = threading.Event()

        def other() -> None:
            with store.exclusive(same_stripe[1], wait_s=30):
                entered.set()

        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.5)
    thread.join(10)
    assert entered.is_set() and held < 5


def test_a_put_under_the_cap_does_not_scan_the_directory(tmp_path, monkeypatch):
    """A cold prompt writes one entry per document: each put once stat-ed every file of
    the store, so puts slowed as the store filled. The size tally spares the scans until
    the cap comes near, or the tally is older than RESCAN_S."""
    from ragsnap.cache.backends import file_store

    store = FileKVStore(tmp_path, max_bytes=10**9)
    scans = []
    real = store._entries
    monkeypatch.setattr(store, "_entries", lambda *a: scans.append(1) or real(*a))
    for i in range(200):
        assert store.put(_key(n=i), b"x" * 100)
    assert len(scans) == 1  # the first put, which found no tally
    monkeypatch.setattr(file_store.time, "time", lambda: 10**10)  # the tally grew stale
    store.put(_key(n=500), b"x" * 100)
    assert len(scans) == 2
    assert store.stats()["entries"] == 201


def test_stores_sharing_a_directory_count_each_others_puts(tmp_path):
    """Two stores on one folder (two processes) keep it under the cap together."""
    stores = [FileKVStore(tmp_path, max_bytes=5000), FileKVStore(tmp_path, max_bytes=5000)]
    for i in range(12):
        assert stores[i % 2].put(_key(n=i), bytes([i]) * 1000)
        assert FileKVStore(tmp_path).stats()["bytes"] <= 5000
    assert stores[0].get(_key(n=11)) == bytes([11]) * 1000
