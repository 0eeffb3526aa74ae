"""The shared frame of this process's in-memory cache maps: entries by key under a lock,
at most ``max_bytes`` in all (the subclasses decide what happens past it)."""

from __future__ import annotations

import threading
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
