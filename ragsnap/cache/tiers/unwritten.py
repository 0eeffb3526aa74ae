"""Compressed entries this process computed and has not written to the store yet.

Writing an entry (checksum, file or Redis write) before the answer's first token delays
it: 8 new questions over seen documents, finished together, spent 0.9 s writing their 8
entries. So an entry is serialized when it is computed, kept here, and written after the
answer (with the document-prefix entry, by the scheduler's store thread). Meanwhile a
request for the same entry in this process reads the very bytes the store would return,
so its answer is the one a store hit gives. Other processes see the entry once it is
written.

The bytes are bounded: an entry that does not fit is written at once, as before.
"""

from __future__ import annotations

from collections.abc import Hashable

from ragsnap.cache.tiers.bounded import BoundedMap


class UnwrittenEntries(BoundedMap[bytes]):
    """A thread-safe map of serialized entries waiting for their write, at most
    ``max_bytes`` in all (0: none; every entry is written at once)."""

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            return self._entries.get(key)

    def hold(self, key: Hashable, payload: bytes) -> bool:
        """Keep ``payload`` until :meth:`written`; False when it does not fit beside the
        entries already waiting (the caller writes it now)."""
        with self._lock:
            old = self._entries.get(key)
            held = self._bytes - (len(old) if old is not None else 0)
            if held + len(payload) > self.max_bytes:
                return False
            self._entries[key] = payload
            self._bytes = held + len(payload)
            return True

    def written(self, key: Hashable) -> None:
        """Forget ``key``'s entry: the store has it now (or refused it)."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
