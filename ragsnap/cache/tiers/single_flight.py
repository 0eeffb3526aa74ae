"""Single flight in one process: one holder per key; the others wait, then read the cache.

Stores layer their cross-process lock (a Redis key with a TTL, a file lock) on top of
:class:`KeyedLocks`, so within a process only one thread per key ever contends for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


class KeyedLocks:
    """A lock per key, created on first use and dropped when its last user leaves."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, tuple[threading.Lock, int]] = {}

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)

    @contextmanager
    def hold(self, key: Hashable, wait_s: float) -> Iterator[bool]:
        """Hold ``key``'s lock; yields False when ``wait_s`` passed without getting it
        (the caller then goes ahead unguarded rather than failing)."""
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        acquired = lock.acquire(timeout=wait_s)
        if not acquired:
            logger.warning(
                "waited %.0fs for another computation of the same entry; going ahead", wait_s
            )
        try:
            yield acquired
        finally:
            if acquired:
                lock.release()
            with self._guard:
                lock, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)
