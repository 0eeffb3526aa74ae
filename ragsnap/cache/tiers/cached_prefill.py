"""The cache tiers of a prompt: lookup into a plan, and storage of what the engine computed.

:meth:`CachedPrefill.plan` finds what the tiers hold for a prompt and returns a data-only
plan (:mod:`ragsnap.cache.tiers.plans`): an exact hit (the compressed entry), a prefix hit
(the document prefix's full KV), a document hit (the documents' pieces) or cold. It reads
entries and computes nothing; the engine executes the plan with the model
(:mod:`ragsnap.engine.execute`) and hands back what it computed: the compressed entry
(:meth:`CachedPrefill.store_result`) and a computed or assembled document prefix
(:meth:`CachedPrefill.store_prefix`).

A cold prompt's document prefix is written with the prompt's entry when the per-document
tier is on (its pieces are views into it, :mod:`ragsnap.cache.tiers.documents`) or
``prefix_store`` is ``always``; otherwise, and for an assembled prefix, it stays in this
process's prefix memory and is written once its document set recurs. A press that
propagates (query-aware prefill) computes a document set seen for the first time whole, with
no prefix entry; when the set recurs its prefix is computed and stored, so its later
requests are prefix hits.

A computed compressed entry is written after the answer (with the prefix entry), and serves
this process's requests for it from memory until then (:mod:`ragsnap.cache.tiers.unwritten`).
Store errors never fail a request: an unreachable store makes the answer ``unavailable``
and computes without it; a damaged or stale entry is deleted and recomputed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ragsnap.cache import keys
from ragsnap.cache.backends.store import EntryKey, KVStore, StoreUnavailable
from ragsnap.cache.report import CacheReport
from ragsnap.cache.serialization import (
    KIND_COMPRESSED,
    KIND_PREFIX,
    StaleEntry,
    StoredPrefill,
    deserialize_prefill,
    deserialize_prefix,
    serialize_prefill,
    serialize_prefix,
)
from ragsnap.cache.tiers.documents import DocumentTier
from ragsnap.cache.tiers.hit_memory import HitMemory
from ragsnap.cache.tiers.orders import RecordedOrders
from ragsnap.cache.tiers.plans import Cold, DocumentHit, ExactHit, Lookup, Plan, PrefixHit
from ragsnap.cache.tiers.prefix_memory import Layers, PrefixMemory
from ragsnap.cache.tiers.unwritten import UnwrittenEntries

if TYPE_CHECKING:
    from ragsnap.prompt.assembly import PromptLayout
    from ragsnap.runtime.loading.models import LoadedModel
    from ragsnap.runtime.prefill import PrefillResult

logger = logging.getLogger(__name__)

FLIGHT_WAIT_S = 600.0
# a document set's prefix computed once, recorded in the store (see CachedPrefill._recurs)
KIND_SEEN = "seen"
# document prefixes remembered as seen (keys only, oldest dropped)
SEEN_PREFIXES = 4096
# document prefixes kept in memory: ten 2K-token prompts of the embedded model in float32
DEFAULT_PREFIX_MEMORY_BYTES = 1 << 30
# compressed entries waiting for their write: twenty of 2K tokens at budget 256, float32
DEFAULT_UNWRITTEN_BYTES = 256 << 20
# compressed entries kept in memory once read or written: twenty of the same
DEFAULT_HIT_MEMORY_BYTES = 256 << 20


def _label(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def stored_bytes(layers: Layers, dtype: torch.dtype | None) -> int:
    """The tensor bytes of ``layers`` stored in ``dtype`` (None: their own)."""
    size = dtype.itemsize if dtype is not None else None
    scales = 4 if dtype == torch.int8 else 0  # a float32 scale per vector
    return sum(
        (k.numel() + v.numel()) * (size or k.element_size())
        + (k.numel() // k.shape[-1] + v.numel() // v.shape[-1]) * scales
        for k, v in layers
    )


def _storing(plan: Plan) -> bool:
    """Whether executing ``plan`` leaves entries to store (not an exact hit, not while the
    store is unavailable)."""
    if isinstance(plan, ExactHit) or plan.report.status == "unavailable":
        return False
    return not isinstance(plan, Cold) or plan.storing


def _remember(seen: OrderedDict[EntryKey, None], key: EntryKey) -> None:
    """Record ``key`` as the most recent of ``seen`` (the oldest past ``SEEN_PREFIXES`` go)."""
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > SEEN_PREFIXES:
        seen.popitem(last=False)


class CachedPrefill:
    """The tiers of a :class:`KVStore` for the ``loaded`` model: plans and storage."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore,
        check_layers: Callable[[Layers], object],
        *,
        prefix_cache: bool = True,
        prefix_store: str = "recurring",
        storage_dtype: torch.dtype | None = None,
        prefix_dtype: torch.dtype | None = None,
        document_cache: bool = False,
        blend_reason: str | None = None,
        prefix_memory_bytes: int = DEFAULT_PREFIX_MEMORY_BYTES,
        unwritten_bytes: int = DEFAULT_UNWRITTEN_BYTES,
        hit_memory_bytes: int = DEFAULT_HIT_MEMORY_BYTES,
    ) -> None:
        """``storage_dtype`` and ``prefix_dtype``: how compressed entries and document
        prefixes are stored (None: the model's dtype). ``prefix_store``: when a computed
        document prefix is written to the store, ``recurring`` (once its document set
        recurs; the first time it stays in this process's prefix memory only) or
        ``always``. ``document_cache`` keeps each document's KV for prompts that combine
        them anew (unless ``blend_reason`` says why the model cannot assemble them);
        ``check_layers`` raises for layers that do not fit the model (a loaded entry that
        does not is a miss). ``prefix_memory_bytes`` of the most recently used document
        prefixes stay in this process's memory in front of the store
        (:mod:`ragsnap.cache.tiers.prefix_memory`); compressed entries wait for their write
        after the answer in up to ``unwritten_bytes`` of memory
        (:mod:`ragsnap.cache.tiers.unwritten`); the most recently read or written ones stay
        loaded in up to ``hit_memory_bytes`` (:mod:`ragsnap.cache.tiers.hit_memory`)."""
        self.check_layers = check_layers
        self.loaded = loaded
        self.store = store
        if prefix_store not in ("recurring", "always"):
            raise ValueError(f"prefix_store must be recurring or always, got {prefix_store!r}")
        self.prefix_cache = prefix_cache
        self.prefix_store = prefix_store
        self.storage_dtype = storage_dtype
        self.prefix_dtype = prefix_dtype
        self.memory = PrefixMemory(prefix_memory_bytes if prefix_cache else 0)
        self.unwritten = UnwrittenEntries(unwritten_bytes)
        self.hits = HitMemory(hit_memory_bytes)
        self.documents = DocumentTier(self, blend_reason) if document_cache else None
        # document prefixes computed here before (see _recurs)
        self.seen_prefixes: OrderedDict[EntryKey, None] = OrderedDict()
        # prefixes held in the prefix memory and not written (prefix_store "recurring")
        self.memory_only: OrderedDict[EntryKey, None] = OrderedDict()
        # the layout each document set was first given (the "stable" document order)
        self.orders = RecordedOrders(store)

    # -- memory -----------------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        """Bytes the in-memory tiers hold now (prefixes, unwritten and loaded entries)."""
        return sum(tier.nbytes for tier in self._memory_tiers)

    def fit_memory(self, max_bytes: int) -> int:
        """Bound the in-memory tiers to ``max_bytes`` together, each cut in proportion to
        its own bound when they exceed it; returns their bound together."""
        tiers = self._memory_tiers
        total = sum(tier.max_bytes for tier in tiers)
        if total > max_bytes:
            for tier in tiers:
                tier.resize(tier.max_bytes * max_bytes // total)
        return sum(tier.max_bytes for tier in tiers)

    @property
    def _memory_tiers(self) -> tuple[PrefixMemory, UnwrittenEntries, HitMemory]:
        return (self.memory, self.unwritten, self.hits)

    # -- keys -------------------------------------------------------------------------

    def model_identity(self) -> dict[str, str]:
        loaded = self.loaded
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        if loaded.matmul_precision != "highest":  # other products, other entries
            dtype += f"-{loaded.matmul_precision}"
        if loaded.four_bit:  # other weights, other entries
            dtype += "-4bit"
        return keys.model_identity(loaded.model_id, loaded.revision, dtype, loaded.device.type)

    def entry_identity(self) -> dict[str, Any]:
        """What a loaded entry must match and where it goes: the deserializers' model_id,
        revision, device and dtype."""
        loaded = self.loaded
        return {
            "model_id": loaded.model_id,
            "revision": loaded.revision,
            "device": loaded.device,
            "dtype": next(loaded.model.parameters()).dtype,
        }

    def storage_label(self) -> str | None:
        return _label(self.storage_dtype)

    def prefix_label(self) -> str | None:
        return _label(self.prefix_dtype)

    def entry_keys(
        self,
        layout: PromptLayout,
        press_config: dict[str, Any],
        question: str,
        namespace: str | None,
    ) -> tuple[EntryKey, EntryKey]:
        """The compressed-entry key and the prefix-entry key of this prompt."""
        model = self.model_identity()
        doc_hashes = [d.content_hash for d in layout.documents]
        compressed = keys.compressed_key(
            namespace,
            model=model,
            template_version=layout.template_version,
            press_config=press_config,
            doc_hashes=doc_hashes,
            question=question,
            prompt_ids=layout.input_ids,
            storage_dtype=self.storage_label(),
        )
        prefix = keys.prefix_key(
            namespace,
            model=model,
            template_version=layout.template_version,
            doc_hashes=doc_hashes,
            prefix_ids=layout.input_ids[: layout.prefix_len],
            storage_dtype=self.prefix_label(),
        )
        return compressed, prefix

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a prompt's document prefix is ever reused (then it is computed apart)."""
        return self.prefix_cache or self.documents is not None

    # -- the plan -----------------------------------------------------------------------

    def plan(self, layout: PromptLayout, lookup: Lookup) -> Plan:
        """What the tiers hold for ``layout``: the plan to execute (see
        :mod:`ragsnap.cache.tiers.plans`). Reads entries, computes nothing, never raises
        for the store."""
        report = CacheReport(status="miss")
        ckey, pkey = self.entry_keys(layout, lookup.press_config, lookup.question, lookup.namespace)
        stored = self.load_exact(ckey, report)
        if stored is not None:
            return ExactHit(ckey, stored, report)
        storing = report.status != "unavailable"
        split = lookup.split if self.reuses_prefixes else 0
        if storing and split > 0:
            prefix = self._load_prefix(pkey, layout, report) if self.prefix_cache else None
            if prefix is not None:
                report.status, report.tier = "prefix-hit", "prefix"
                return PrefixHit(ckey, prefix, split, report)
            pieces = None
            if self.documents is not None:
                pieces = self.documents.find(layout, lookup.namespace, report)
                storing = report.status != "unavailable"
            if pieces is not None:
                report.status, report.tier = "document-hit", "documents"
                head_len = layout.doc_spans[0][0]
                return DocumentHit(ckey, pkey, split, head_len, pieces, report)
            if storing and lookup.propagates and not self._recurs(pkey):
                # query-aware prefill needs no full document KV: a document set seen for the
                # first time takes it (no prefix entry); one that recurs gets the full
                # prefill and its prefix entry, so its later requests are prefix hits
                split = 0
        report.tier = "cold"
        return Cold(ckey, pkey, split, storing, report)

    @contextmanager
    def computing(self, plan: Plan) -> Iterator[ExactHit | None]:
        """Hold the computation of ``plan``'s entry (one request computes it, the others
        wait for it); gives the exact hit another request stored meanwhile, else None."""
        if isinstance(plan, ExactHit):
            yield plan
            return
        if not _storing(plan):
            yield None
            return
        with self.store.exclusive(plan.key, wait_s=FLIGHT_WAIT_S):
            stored = self.load_exact(plan.key, plan.report)
            yield None if stored is None else ExactHit(plan.key, stored, plan.report)

    @contextmanager
    def computing_many(self, plans: Sequence[PrefixHit]) -> Iterator[list[ExactHit | None]]:
        """:meth:`computing` for several prefix hits finished together (each key once)."""
        with self.store.exclusive_many([p.key for p in plans], wait_s=FLIGHT_WAIT_S):
            found = []
            for plan in plans:
                stored = self.load_exact(plan.key, plan.report)
                found.append(None if stored is None else ExactHit(plan.key, stored, plan.report))
            yield found

    # -- what the engine computed ---------------------------------------------------------

    def store_result(self, plan: Plan, result: PrefillResult) -> None:
        """Leave ``result`` (the prompt's compressed cache) to be written under the plan's
        key after the answer; nothing when the store is unavailable."""
        if _storing(plan):
            self._put_later(plan.key, result, plan.report)

    def store_prefix(
        self,
        plan: Cold | DocumentHit,
        layout: PromptLayout,
        prefix: Layers,
        namespace: str | None,
    ) -> None:
        """Keep the document prefix ``prefix`` (``[1, Hkv, prefix_len, D]`` per layer) that
        executing ``plan`` computed or assembled: in memory, and written (see the module
        docstring) with the pieces of the documents it is the first to hold."""
        if not _storing(plan):
            return
        slots = self.documents.new_slots(plan, layout, namespace) if self.documents else []
        if not self.prefix_cache and not slots:
            return  # nothing would read it
        pkey = plan.prefix_key
        # as computed until its entry is written (finish): rounding it to the storage dtype
        # took 0.28 s of a 4.5K-token miss's first token in int8
        kept = self.prefix_cache and self.memory.put(pkey, prefix)
        if slots or self.prefix_store == "always" or not kept or self._recurs(pkey):
            self._write_prefix(pkey, prefix, layout, plan.report)
            if self.documents is not None:
                self.documents.point(slots, layout.prefix_len, pkey, plan.report)
        else:  # seen once: the memory serves it, written if the set recurs
            _remember(self.memory_only, pkey)

    def finish(self, report: CacheReport) -> None:
        """Write what was left for after the answer (its compressed entry, a miss's prefix
        entry); a second call writes nothing. Store errors are logged, never raised."""
        pending, report.pending = report.pending, []
        for key, payload in pending:
            counted = CacheReport(status=report.status)  # its bytes were counted when queued
            data = None if report.status == "unavailable" else self._put(key, payload, counted)
            report.status = counted.status
            if data is not None and key.kind == KIND_COMPRESSED:
                self._deserialize(key, data)  # the next hit, from memory
            elif data is not None and key.kind == KIND_PREFIX:
                self._as_written(key, data)
            self.unwritten.written(key)

    def _as_written(self, key: EntryKey, data: bytes) -> None:
        """The prefix memory's copy of ``key``, whose entry ``data`` was just written, as a
        load of the entry gives it (so every process's next prefix hit starts from the
        same KV); loaded from ``data`` rather than rounded again (half the time)."""
        held = self.memory.get(key)
        if held is None or self.prefix_dtype is None:
            return
        try:
            layers = deserialize_prefix(
                data, prefix_len=held[0][0].shape[2], **self.entry_identity()
            )
        except Exception:  # what was just written does not load: nothing serves from it
            logger.exception("prefix entry %s does not load back", key.digest[:12])
            self.memory.discard(key)
            return
        self.memory.put(key, layers)

    # -- store access, never raising ----------------------------------------------------

    def read_entry(self, key: EntryKey, report: CacheReport) -> bytes | None:
        unwritten = self.unwritten.get(key)
        if unwritten is not None:
            return unwritten
        try:
            return self.store.get(key)
        except StoreUnavailable as exc:
            logger.warning("cache unavailable, answering without it: %s", exc)
            report.status = "unavailable"
        except Exception:  # a cache must never fail a request
            logger.exception("cache read failed for %s; treating it as a miss", key.digest[:12])
        return None

    def _put(
        self, key: EntryKey, payload: Callable[[], bytes], report: CacheReport
    ) -> bytes | None:
        """Write ``payload`` under ``key``; the bytes the store took, or None."""
        try:
            data = payload()
            if self.store.put(key, data):
                report.bytes_written += len(data)
                return data
        except StoreUnavailable as exc:
            logger.warning("cache unavailable, entry not stored: %s", exc)
            report.status = "unavailable"
        except Exception:
            logger.exception("cache write failed for %s; the answer goes on", key.digest[:12])
        return None

    def _put_later(self, key: EntryKey, result: PrefillResult, report: CacheReport) -> None:
        """Serialize ``result`` now and write it after the answer (:meth:`finish`), or now
        when the unwritten entries have no room for it."""
        try:
            payload = self._serialize(result)
        except Exception:
            logger.exception("cache entry %s not serialized; the answer goes on", key.digest[:12])
            return
        if self.unwritten.hold(key, payload):
            report.pending.insert(0, (key, lambda: payload))
            report.bytes_written += len(payload)
        else:
            self._put(key, lambda: payload, report)

    def drop_entry(self, key: EntryKey, reason: Exception) -> None:
        logger.warning(
            "cache entry %s unusable (%s); deleting and recomputing", key.digest[:12], reason
        )
        self.unwritten.written(key)
        self.hits.discard(key)
        self.store.reject(key, "stale" if isinstance(reason, StaleEntry) else "unreadable")

    # -- hit --------------------------------------------------------------------------

    def load_exact(self, key: EntryKey, report: CacheReport) -> StoredPrefill | None:
        """The compressed entry under ``key`` (memory, then the store), or None."""
        started = time.perf_counter()
        stored = self.hits.get(key)
        if stored is None:
            payload = self.read_entry(key, report)
            if payload is None:
                return None
            stored = self._deserialize(key, payload)
            if stored is None:
                return None
            report.bytes_read += len(payload)
        report.status, report.tier = "hit", "exact"
        report.load_s += time.perf_counter() - started
        return stored

    def _deserialize(self, key: EntryKey, payload: bytes) -> StoredPrefill | None:
        """``payload`` loaded and remembered in :attr:`hits`; None (and the entry dropped)
        when it does not load."""
        try:
            stored = deserialize_prefill(payload, **self.entry_identity())
            self.check_layers(stored.layers)  # the model's layer layout, or a miss here
        except Exception as exc:  # any entry that does not load is a miss, never a 500
            self.drop_entry(key, exc)
            return None
        self.hits.put(key, stored)
        return stored

    # -- prefixes ---------------------------------------------------------------------

    def _recurs(self, pkey: EntryKey) -> bool:
        """Whether ``pkey``'s document set was computed before, here or by any process of
        this store (a small marker entry records it there; a store error counts as not)."""
        if pkey in self.seen_prefixes:
            _remember(self.seen_prefixes, pkey)
            return True
        _remember(self.seen_prefixes, pkey)
        marker = EntryKey(pkey.namespace, KIND_SEEN, pkey.digest)
        try:
            if self.store.get(marker) is not None:
                return True
            self.store.put(marker, b"seen")
        except Exception:  # a marker must never fail a request
            logger.warning("could not record %s as seen", pkey.label, exc_info=True)
        return False

    def _write_prefix(
        self, pkey: EntryKey, prefix: Layers, layout: PromptLayout, report: CacheReport
    ) -> None:
        """Leave ``prefix``'s entry for the store thread to write after the answer."""
        self.memory_only.pop(pkey, None)
        report.pending.append((pkey, self._prefix_payload(prefix, layout)))
        report.bytes_written += stored_bytes(prefix, self.prefix_dtype)

    def _prefix_payload(self, prefix: Layers, layout: PromptLayout) -> Callable[[], bytes]:
        loaded = self.loaded
        return lambda: serialize_prefix(
            prefix,
            prefix_len=layout.prefix_len,
            model_id=loaded.model_id,
            revision=loaded.revision,
            storage_dtype=self.prefix_dtype,
        )

    def _load_prefix(
        self, key: EntryKey, layout: PromptLayout, report: CacheReport
    ) -> Layers | None:
        """The document prefix of ``layout`` under ``key``; one kept in memory only is
        written now (its document set recurs)."""
        layers = self.load_prefix_entry(key, layout.prefix_len, report)
        if layers is not None and key in self.memory_only:
            self._write_prefix(key, layers, layout, report)
        return layers

    def load_prefix_entry(
        self, key: EntryKey, prefix_len: int, report: CacheReport
    ) -> Layers | None:
        """The prefix entry under ``key`` (``[1, Hkv, prefix_len, D]`` per layer), from the
        prefix memory or the store (then kept in memory), or None."""
        started = time.perf_counter()
        kept = self.memory.get(key)
        if kept is not None:
            report.load_s += time.perf_counter() - started
            return kept
        payload = self.read_entry(key, report)
        if payload is None:
            return None
        try:
            layers = deserialize_prefix(payload, prefix_len=prefix_len, **self.entry_identity())
            self.check_layers(layers)  # the model's layer layout, or a miss here
        except Exception as exc:  # any entry that does not load is a miss, never a 500
            self.drop_entry(key, exc)
            return None
        self.memory.put(key, layers)
        report.bytes_read += len(payload)
        report.load_s += time.perf_counter() - started
        return layers

    def _serialize(self, result: PrefillResult) -> bytes:
        loaded = self.loaded
        return serialize_prefill(
            result.layers,
            result.kept,
            result.next_logits,
            original_length=result.original_length,
            press_config=result.press_config,
            kv_bytes_full=result.kv_bytes_full,
            model_id=loaded.model_id,
            revision=loaded.revision,
            storage_dtype=self.storage_dtype,
            decode_bias=result.bias,
            draft=result.draft,
        )
