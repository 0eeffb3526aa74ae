"""Safe cache defaults (issue 40): sealed without configuration, shared stores refused
without a key, and a store that touches only what it wrote."""

from __future__ import annotations

import logging
import os
import stat
import uuid

import pytest

from ragsnap.cache import EntryKey, open_store
from ragsnap.cache.backends.file_store import KEY_FILE, FileKVStore
from ragsnap.cache.backends.sealed import SealedKVStore
from ragsnap.errors import ConfigError


def _key(namespace: str = "default") -> EntryKey:
    return EntryKey(namespace, "kv", uuid.uuid4().hex * 2)


@pytest.fixture(autouse=True)
def _no_configured_key(monkeypatch):
    monkeypatch.delenv("RAGSNAP_CACHE_KEY", raising=False)


def test_a_file_store_is_sealed_with_a_private_key_of_its_own(tmp_path):
    store = open_store(f"file://{tmp_path}")
    assert isinstance(store, SealedKVStore)
    key_file = tmp_path / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key, payload = _key(), b"the tenant's private document " * 20
    assert store.put(key, payload)
    assert b"private document" not in store.inner._path(key).read_bytes()  # type: ignore[attr-defined]
    again = open_store(f"file://{tmp_path}")  # another process: the same key file
    assert again.get(key) == payload
    assert key_file.read_text() == (tmp_path / KEY_FILE).read_text()


def test_entries_of_another_folder_key_or_in_plaintext_are_misses_and_deleted(tmp_path):
    store = open_store(f"file://{tmp_path}")
    key, payload = _key(), os.urandom(2000)
    plain = FileKVStore(tmp_path)
    plain.put(key, payload)  # an entry from before sealing was the default
    assert store.get(key) is None and not plain._path(key).exists()
    other = open_store(f"file://{tmp_path / 'elsewhere'}")
    plain.put(key, other.seal(key, payload))  # type: ignore[attr-defined]
    assert store.get(key) is None and not plain._path(key).exists()
    assert store.rejections == {"unauthenticated": 2}


def test_a_shared_store_without_a_key_is_refused_naming_the_setting(monkeypatch):
    pytest.importorskip("redis")
    with pytest.raises(ConfigError, match="RAGSNAP_CACHE_KEY.*unsealed=1"):
        open_store("redis://127.0.0.1:1/0")
    monkeypatch.setenv("RAGSNAP_CACHE_KEY", "shared secret")
    assert isinstance(open_store("redis://127.0.0.1:1/0"), SealedKVStore)


def test_unsealed_is_explicit_loud_and_exclusive_with_a_key(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        store = open_store(f"file://{tmp_path}?unsealed=1")
    assert isinstance(store, FileKVStore) and "UNSEALED" in caplog.text
    assert not (tmp_path / KEY_FILE).exists()
    with pytest.raises(ConfigError, match="unsealed=1 but a cache key"):
        open_store(f"file://{tmp_path}?unsealed=1", key="k")
    with pytest.raises(ConfigError, match="unsealed='maybe'"):
        open_store(f"file://{tmp_path}?unsealed=maybe")


@pytest.mark.parametrize("query", ["ttl=abc", "max_byte=1MB", "key=x"])
def test_unknown_file_url_options_are_refused_by_name(tmp_path, query):
    with pytest.raises(
        ConfigError, match=f"unknown file:// cache URL option '{query.split('=')[0]}'"
    ):
        open_store(f"file://{tmp_path}?{query}")


def test_clear_removes_only_its_own_entries_and_keeps_foreign_files(tmp_path):
    store = open_store(f"file://{tmp_path}")
    mine = [_key(), _key(), _key("other")]
    for key in mine:
        store.put(key, b"x" * 100)
    foreign = [
        tmp_path / "default" / "notes.txt",
        tmp_path / "default" / f"kv-{'0' * 64}.kv",  # an entry's name, not its format
        tmp_path / "default" / "sub" / "kv-x.kv",
        tmp_path / "photos" / "a.kv",
    ]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not ours")
    assert store.clear("default") == 2
    assert store.clear("photos") == 0
    assert store.stats()["entries"] == 1
    assert store.clear() == 1
    assert all(path.read_bytes() == b"not ours" for path in foreign)
    assert (tmp_path / KEY_FILE).exists()
    assert not (tmp_path / "other").exists()  # emptied by clear: its folder goes too
    assert store.stats()["entries"] == 0


def test_eviction_never_deletes_a_foreign_file(tmp_path):
    store = FileKVStore(tmp_path, max_bytes=3000)
    foreign = tmp_path / "default" / f"kv-{'1' * 64}.kv"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"z" * 5000)
    os.utime(foreign, (1, 1))  # the oldest by far
    for _ in range(4):
        store.put(_key(), b"y" * 1000)
    assert foreign.read_bytes() == b"z" * 5000
    assert store.stats()["entries"] <= 2


def test_a_damaged_key_file_is_one_clear_error(tmp_path):
    open_store(f"file://{tmp_path}")
    (tmp_path / KEY_FILE).write_text("not hex\n")
    with pytest.raises(ConfigError, match="does not hold a hex key"):
        open_store(f"file://{tmp_path}")


def test_the_unsealed_option_leaves_the_others_intact(tmp_path):
    store = open_store(f"file://{tmp_path}?max_bytes=2MB&unsealed=1", key="")
    assert isinstance(store, FileKVStore) and store.max_bytes == 2 * 2**20
