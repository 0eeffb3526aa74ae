"""Cache entries under hostile and careless conditions: private file modes, sealed
(encrypted, authenticated) entries, forged checksums, forged metadata, a full disk,
namespaces named like internal folders, and bad cache URL options."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from ragsnap.cache import EntryKey, open_store
from ragsnap.cache.backends.file_store import MAGIC, FileKVStore
from ragsnap.cache.backends.sealed import SealedKVStore
from ragsnap.cache.backends.store import namespace_label
from ragsnap.cache.serialization import StaleEntry, deserialize_prefill, deserialize_prefix
from ragsnap.errors import ConfigError
from tests.test_cache_serialization import MODEL, _serialize


def _key(namespace: str = "default", n: int | None = None) -> EntryKey:
    digest = f"{n:064x}" if n is not None else uuid.uuid4().hex * 2
    return EntryKey(namespace, "kv", digest)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _forge_file(store: FileKVStore, key: EntryKey, payload: bytes) -> None:
    """Rewrite an entry file with a checksum that matches the new payload."""
    store._path(key).write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)


def _with_metadata(payload: bytes, **changes: str) -> bytes:
    tensors = load(payload)
    size = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8 : 8 + size])["__metadata__"]
    meta.update(changes)
    return save(tensors, metadata=meta)


def _with_tensor(payload: bytes, name: str, tensor: torch.Tensor) -> bytes:
    tensors = load(payload)
    size = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8 : 8 + size])["__metadata__"]
    tensors[name] = tensor
    return save(tensors, metadata=meta)


# -- private files ----------------------------------------------------------------------


def test_folders_and_files_are_private_whatever_the_umask(tmp_path):
    root = tmp_path / "kv"
    previous = os.umask(0)  # the most permissive umask there is
    try:
        store = FileKVStore(root)
        key = _key("tenant-a")
        assert store.put(key, b"secret kv")
        with store.exclusive(key, wait_s=5):
            pass
    finally:
        os.umask(previous)
    assert _mode(root) == 0o700
    assert _mode(root / "tenant-a") == 0o700
    assert _mode(root / ".locks") == 0o700
    assert _mode(store._path(key)) == 0o600
    locks = list((root / ".locks").iterdir())
    assert locks and all(_mode(p) & 0o077 == 0 for p in locks)


def test_existing_folders_keep_their_mode_and_an_open_one_is_reported(tmp_path, caplog):
    root = tmp_path / "kv"
    (root / "default").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "default", 0o777)
    FileKVStore(root).put(_key(), b"x")
    FileKVStore(root).put(_key("other"), b"y")
    assert _mode(root) == 0o755 and _mode(root / "default") == 0o777
    assert _mode(root / "other") == 0o700 and _mode(root / ".locks") == 0o700  # made here
    assert "readable by others" in caplog.text


def test_missing_parents_are_made_private_and_present_ones_left_alone(tmp_path):
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "a" / "b"
    FileKVStore(root).put(_key(), b"x")
    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / "a") == 0o700 and _mode(root) == 0o700


def test_a_namespace_named_like_the_lock_folder_does_not_collide(tmp_path):
    store = FileKVStore(tmp_path)
    assert namespace_label(".locks").startswith("h-")
    key = _key(".locks")
    assert store.put(key, b"payload")
    assert store._path(key).parent != tmp_path / ".locks"
    with store.exclusive(key, wait_s=5):  # the lock folder still works
        pass
    assert store.get(key) == b"payload"
    assert store.stats()["entries"] == 1
    assert store.clear(".locks") == 1
    assert (tmp_path / ".locks").is_dir()


# -- a full disk --------------------------------------------------------------------------


class _SmallDisk(FileKVStore):
    """A file store on a disk of ``capacity`` bytes: writes past it fail with ENOSPC, as
    the kernel does (the size cap is far larger, so only the disk limits)."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(root, max_bytes=2**30)
        self.capacity = capacity
        self.refusals = 0

    def _write(self, path: Path, payload: bytes) -> None:
        used = sum(st.st_size for _, st in self._entries())
        if used + len(payload) + len(MAGIC) + 32 > self.capacity:
            self.refusals += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._write(path, payload)


def test_a_full_disk_evicts_the_oldest_entries_and_stores_the_new_one(tmp_path):
    store = _SmallDisk(tmp_path, capacity=3 * 1100)
    keys = [_key(n=i) for i in range(3)]
    for i, key in enumerate(keys):
        assert store.put(key, bytes([i]) * 1000)
        os.utime(store._path(key), (1000 + i, 1000 + i))
    new = _key(n=9)
    assert store.put(new, b"n" * 1000)
    assert store.refusals == 1
    assert store.get(new) == b"n" * 1000
    assert store.get(keys[0]) is None  # the least recently used made room
    assert store.get(keys[2]) is not None


def test_a_full_disk_with_nothing_to_evict_gives_up_caching(tmp_path):
    store = _SmallDisk(tmp_path, capacity=100)
    assert store.put(_key(), b"x" * 1000) is False
    assert store.stats()["entries"] == 0
    assert not any(p.name.endswith(".tmp") for p, _ in store._entries())


# -- sealed entries ---------------------------------------------------------------------


def test_sealed_file_entries_are_encrypted_and_round_trip(tmp_path):
    store = open_store(f"file://{tmp_path}", key="correct horse")
    assert isinstance(store, SealedKVStore)
    key, secret = _key(), b"the tenant's private document " * 20
    assert store.put(key, secret)
    assert store.get(key) == secret
    on_disk = store.inner._path(key).read_bytes()  # type: ignore[attr-defined]
    assert b"private document" not in on_disk
    assert store.stats()["sealed"] is True


@pytest.mark.parametrize("how", ["flip", "other key", "moved", "unsealed"])
def test_a_forged_sealed_entry_is_a_miss_deleted_and_counted(tmp_path, how):
    store = open_store(f"file://{tmp_path}", key="k1")
    assert isinstance(store, SealedKVStore)
    inner: FileKVStore = store.inner  # type: ignore[assignment]
    key, payload = _key(), os.urandom(3000)
    store.put(key, payload)
    sealed = inner.get(key)
    assert sealed is not None
    if how == "flip":  # changed bytes, checksum recomputed to match
        forged = bytearray(sealed)
        forged[-40] ^= 0x01
        _forge_file(inner, key, bytes(forged))
    elif how == "other key":
        inner.put(key, SealedKVStore(FileKVStore(tmp_path), "k2").seal(key, payload))
    elif how == "moved":  # a valid entry of another question copied under this key
        other = _key()
        inner.put(key, store.seal(other, os.urandom(3000)))
    else:  # written by someone without the key
        inner.put(key, payload)
    assert store.get(key) is None
    assert not inner._path(key).exists()
    assert store.rejections == {"unauthenticated": 1}


def test_sealed_redis_entries_round_trip_and_reject_forgeries(redis_server, monkeypatch):
    pytest.importorskip("redis")
    monkeypatch.setenv("RAGSNAP_CACHE_KEY", "from the environment")
    store = open_store(redis_server.url + "?chunk_bytes=1000")
    assert isinstance(store, SealedKVStore)
    key, payload = _key(uuid.uuid4().hex), b"private text " * 300
    assert store.put(key, payload)
    assert store.get(key) == payload
    client = store.inner.client  # type: ignore[attr-defined]
    base = f"ragsnap:v1:{key.label}:kv:{{{key.digest}}}"
    assert b"private text" not in b"".join(client.mget(list(client.scan_iter(f"{base}:chunk:*"))))
    # forge: same chunk layout, one byte changed, manifest checksum recomputed
    sealed = bytearray(store.inner.get(key))  # type: ignore[arg-type]
    sealed[100] ^= 0xFF
    store.inner.put(key, bytes(sealed))
    assert store.get(key) is None
    assert client.exists(f"{base}:manifest") == 0
    assert store.rejections["unauthenticated"] == 1
    store.close()


# -- forged entries without a key: checked for consistency ----------------------------


@pytest.mark.parametrize(
    "forge",
    [
        lambda p: _with_metadata(p, dtype="int64"),  # not a float dtype
        lambda p: _with_metadata(p, dtype="no_such_dtype"),
        lambda p: _with_metadata(p, dtype="bfloat16"),  # not the model's dtype
        lambda p: _with_metadata(p, storage_dtype="float16"),  # tensors say float32
        lambda p: _with_metadata(p, num_layers="99999999"),
        lambda p: _with_metadata(p, num_layers="7"),
        lambda p: _with_metadata(p, original_length="five"),
        lambda p: _with_metadata(p, original_length="5"),  # kept positions beyond it
        lambda p: _with_tensor(p, "idx.1", -torch.ones(1, 2, 12, dtype=torch.int16)),
        lambda p: _with_metadata(p, kept_layers='["x"]'),
        lambda p: _with_metadata(p, aliases="[1, 2]"),
        lambda p: _with_tensor(p, "k.1", torch.zeros(1, 2, 12, 8, dtype=torch.float16)),
        lambda p: _with_tensor(p, "v.0", torch.zeros(1, 2, 5, 8)),
        lambda p: _with_tensor(p, "idx.0", torch.zeros(1, 2, 3, dtype=torch.int16)),
        lambda p: _with_tensor(p, "logits", torch.zeros(3, dtype=torch.int32)),
    ],
)
def test_a_forged_entry_with_a_valid_checksum_is_stale(forge):
    payload = _serialize()[0]
    deserialize_prefill(payload, **MODEL, dtype=torch.float32)  # the original loads
    with pytest.raises(StaleEntry):
        deserialize_prefill(forge(payload), **MODEL, dtype=torch.float32)


def test_a_forged_prefix_entry_is_stale():
    from ragsnap.cache.serialization import serialize_prefix

    layers = [(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)) for _ in range(2)]
    payload = serialize_prefix(layers, prefix_len=10, **MODEL)
    assert len(deserialize_prefix(payload, **MODEL, prefix_len=10, dtype=torch.float32)) == 2
    for forged in (
        _with_metadata(payload, dtype="float16"),
        _with_metadata(payload, prefix_len="10.0"),
        _with_tensor(payload, "k.1", torch.randn(1, 2, 9, 8)),
    ):
        with pytest.raises(StaleEntry):
            deserialize_prefix(forged, **MODEL, prefix_len=10, dtype=torch.float32)


def test_a_file_entry_with_a_forged_checksum_is_rejected_by_the_file_store(tmp_path):
    store = FileKVStore(tmp_path)
    key = _key()
    store.put(key, b"a" * 100)
    path = store._path(key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # bytes changed, checksum not
    path.write_bytes(bytes(data))
    assert store.get(key) is None and not path.exists()
    assert store.rejections == {"checksum": 1}


# -- cache URLs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query", ["ttl=abc", "ttl=0", "ttl=1e3", "backoff=nan", "chunk_bytes=lots", "max_backoff=-1"]
)
def test_bad_redis_url_options_are_one_config_error(query):
    pytest.importorskip("redis")
    with pytest.raises(ConfigError) as caught:
        open_store(f"redis://127.0.0.1:1/0?{query}")
    assert "\n" not in str(caught.value)
    assert query.split("=")[0] in str(caught.value) or "positive" in str(caught.value)


def test_redis_ping_asks_the_server(redis_factory):
    pytest.importorskip("redis")
    server = redis_factory()
    store = open_store(server.url, key="k")
    assert store.ping(0.5) is True
    server.stop()
    assert store.ping(0.5) is False
    assert store.available is False  # the backoff starts
    server.start()
    assert store.ping(0.5) is True
    assert store.available is True
    store.close()


def test_redis_auth_urls_work_and_never_show_the_password(redis_factory):
    pytest.importorskip("redis")
    from ragsnap.cache import StoreUnavailable

    server = redis_factory("--requirepass", "s3cret-pw")
    url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    with open_store(url, key="k") as store:
        key = _key(uuid.uuid4().hex)
        assert store.put(key, b"payload") and store.get(key) == b"payload"
        assert "s3cret-pw" not in store.describe() and "s3cret-pw" not in str(store.stats())
        assert store.ping(0.5) is True
    with open_store(f"redis://127.0.0.1:{server.port}/0", key="k") as anonymous:
        assert anonymous.ping(0.5) is False
        with pytest.raises(StoreUnavailable):
            anonymous.get(_key())


def test_a_frozen_redis_costs_one_short_wait_then_the_backoff(redis_factory):
    """A server that stops answering (SIGSTOP: a stuck or swapping host) is a miss after
    ``socket_timeout`` (default 2 s), and the next requests skip it at once."""
    import signal
    import time

    from ragsnap.cache import StoreUnavailable

    pytest.importorskip("redis")
    server = redis_factory()
    store = open_store(server.url + "?socket_timeout=0.5", key="k")
    key = _key(uuid.uuid4().hex)
    assert store.put(key, b"payload") and store.get(key) == b"payload"
    server.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.get(key)
        first = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.get(key)
        again = time.monotonic() - started
    finally:
        server.process.send_signal(signal.SIGCONT)
    assert first < 5 and again < first  # one timeout, then the backoff answers at once
    assert store.available is False
    with pytest.raises(ConfigError, match="socket_timeout"):
        open_store(server.url + "?socket_timeout=0", key="k")
    store.close()
