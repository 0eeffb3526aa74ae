"""Recorded document orders: a document set keeps the layout its first question gave it.

Under the ``relevance`` order each question lays the same documents out anew, so a second
question over a set the store already holds changes the document prefix and misses its
entry. The ``stable`` order records, per document set (its documents' content hashes,
in any order, in one namespace), the order the first question laid the set out in; a
later question over the same set is laid out in that order, so the prefix entry of the
first serves it (a prefix hit). Records live in the store beside the entries they point
to (kind ``order``, a JSON list of content hashes), so every replica and every restart
sees them; a record that does not name a permutation of part of the set is ignored.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence

from ragsnap.cache.backends.store import DEFAULT_NAMESPACE, EntryKey, KVStore
from ragsnap.cache.keys import canonical_digest
from ragsnap.prompt.documents import Document

logger = logging.getLogger(__name__)

KIND_ORDER = "order"
MEMO_SETS = 4096  # the most recent records kept in this process in front of the store


def order_key(
    namespace: str | None, template_version: str, documents: Sequence[Document]
) -> EntryKey:
    """Where the order of ``documents`` (as a set) is recorded: the prompt template and the
    sorted content hashes, nothing of a question, press or model (an order is text)."""
    digest = canonical_digest(
        {
            "kind": KIND_ORDER,
            "template": template_version,
            "documents": sorted(d.content_hash for d in documents),
        }
    )
    return EntryKey(namespace or DEFAULT_NAMESPACE, KIND_ORDER, digest)


class RecordedOrders:
    """Read and write document-set orders in ``store`` (never raising: a store error is an
    unrecorded set), with the most recent ``memo`` records kept in this process."""

    def __init__(self, store: KVStore, memo: int = MEMO_SETS) -> None:
        self.store = store
        self.memo_size = memo
        self._memo: OrderedDict[EntryKey, tuple[str, ...]] = OrderedDict()

    def ordered(
        self, documents: Sequence[Document], template_version: str, namespace: str | None
    ) -> list[Document] | None:
        """``documents`` in their set's recorded order (those the record names first, in its
        order; the rest after them, as given), or None when the set has no record."""
        key = order_key(namespace, template_version, documents)
        hashes = self._memo.get(key) or self._read(key)
        if hashes is None:
            return None
        by_hash = {d.content_hash: d for d in documents}
        if len(set(hashes)) != len(hashes) or not set(hashes) <= by_hash.keys():
            logger.warning("ignoring the order record %s: not of this document set", key.label)
            return None
        self._remember(key, hashes)
        named = set(hashes)
        return [by_hash[h] for h in hashes] + [d for d in documents if d.content_hash not in named]

    def record(
        self,
        documents: Sequence[Document],
        laid_out: Sequence[Document],
        template_version: str,
        namespace: str | None,
    ) -> None:
        """Record ``laid_out`` (the documents a prompt holds, in its order) as the order of
        the set ``documents``, unless the set has one already."""
        key = order_key(namespace, template_version, documents)
        if key in self._memo:
            return
        hashes = tuple(d.content_hash for d in laid_out)
        try:
            if self.store.get(key) is None:
                self.store.put(key, json.dumps(list(hashes)).encode())
        except Exception:  # an order record must never fail a request
            logger.warning("could not record the order of %s", key.label, exc_info=True)
            return
        self._remember(key, hashes)

    def _read(self, key: EntryKey) -> tuple[str, ...] | None:
        try:
            payload = self.store.get(key)
        except Exception:
            logger.warning("could not read the order record %s", key.label, exc_info=True)
            return None
        if payload is None:
            return None
        try:
            hashes = json.loads(payload)
        except ValueError:
            hashes = None
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            logger.warning("ignoring the damaged order record %s", key.label)
            return None
        return tuple(hashes)

    def _remember(self, key: EntryKey, hashes: tuple[str, ...]) -> None:
        self._memo[key] = hashes
        self._memo.move_to_end(key)
        while len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)
