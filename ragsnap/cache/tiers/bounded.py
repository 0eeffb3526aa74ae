"""The shared frame of this process's in-memory cache maps: entries by key under a lock,
at most ``max_bytes`` in all (the subclasses decide what happens past it; :class:`LruMap`
evicts the least recently used)."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class BoundedMap(Generic[Value]):
    """Entries in insertion (or recency) order, their sizes summed in ``nbytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Value] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def resize(self, max_bytes: int) -> None:
        """Hold at most ``max_bytes`` from now on (the entries past it go as the subclass
        decides: see :meth:`_shrink`)."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        with self._lock:
            self.max_bytes = max_bytes
            self._shrink()

    def _shrink(self) -> None:
        """Called under the lock once ``max_bytes`` fell: by default the entries stay until
        they leave on their own (see :class:`LruMap` for eviction)."""


class LruMap(BoundedMap[Value]):
    """A thread-safe LRU: past ``max_bytes``, the least recently used entries go; 0 keeps
    nothing. Values are shared with every reader, who must not write into them."""

    @staticmethod
    @abstractmethod
    def size_of(value: Value) -> int:
        """The bytes ``value`` holds."""

    def get(self, key: Hashable) -> Value | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Value) -> bool:
        """Keep ``value`` under ``key`` (evicting the least recently used); False when it
        alone exceeds the budget."""
        size = self.size_of(value)
        with self._lock:
            if size > self.max_bytes:
                return False
            self._discard(key)
            self._evict_until(self.max_bytes - size)
            self._entries[key] = value
            self._bytes += size
        return True

    def _shrink(self) -> None:
        self._evict_until(self.max_bytes)

    def _evict_until(self, held: int) -> None:
        """Evict the least recently used entries until at most ``held`` bytes remain."""
        while self._entries and self._bytes > held:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= self.size_of(evicted)

    def discard(self, key: Hashable) -> None:
        with self._lock:
            self._discard(key)

    def _discard(self, key: Hashable) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= self.size_of(old)
