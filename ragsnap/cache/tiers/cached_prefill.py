"""The cached prefill: lookup -> hit / prefix hit / document hit / miss, then store.

hit           the compressed KV and the prompt's last logits are loaded; no forward pass.
prefix hit    the full KV of the document prefix is loaded and only the tail (the question
              and the generation prompt) is prefilled on top of it, then compressed with the
              tail's own observation window; when the tail is shorter than the window, the
              loaded prefix is cropped so the forward pass covers the whole window.
              :meth:`CachedPrefill.lookup` finds hits and prefix hits without computing;
              :meth:`CachedPrefill.finish_prefix_hits` finishes several prefix hits in
              shared passes (:mod:`ragsnap.runtime.tails`).
document hit  the prefix is assembled from per-document pieces (any order, any combination;
              see :mod:`ragsnap.cache.tiers.documents`) with a share of its tokens recomputed,
              then the tail is prefilled and compressed as after a prefix hit.
miss          the prompt is prefilled, in the same two steps when a prefix entry is wanted
              (prefix, then tail), so a later prefix hit repeats exactly this computation;
              the pieces of its documents are computed and stored after the answer.
              A press that propagates (query-aware prefill) computes a document set seen
              for the first time in one query-aware pass, storing no prefix entry; when
              the set recurs it is prefilled in the two steps above (prefix entry stored),
              so its later requests are prefix hits (their tails on the full path).

A computed compressed entry is written after the answer (with the prefix entry), and serves
this process's requests for it from memory until then (:mod:`ragsnap.cache.tiers.unwritten`).
Store errors never fail a request: an unreachable store makes the answer ``unavailable``
and computes without it; a damaged or stale entry is deleted and recomputed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragsnap.cache import int8_kv, keys
from ragsnap.cache.backends.store import EntryKey, KVStore, StoreUnavailable
from ragsnap.cache.report import CacheReport
from ragsnap.cache.serialization import (
    KIND_COMPRESSED,
    StaleEntry,
    StoredPrefill,
    deserialize_prefill,
    deserialize_prefix,
    serialize_prefill,
    serialize_prefix,
)
from ragsnap.cache.tiers.documents import DEFAULT_RECOMPUTE_SHARE, DocumentRunner, DocumentTier
from ragsnap.cache.tiers.hit_memory import HitMemory
from ragsnap.cache.tiers.orders import RecordedOrders
from ragsnap.cache.tiers.prefix_memory import Layers, PrefixMemory
from ragsnap.cache.tiers.unwritten import UnwrittenEntries
from ragsnap.compression import Press
from ragsnap.compression.lookup_focus import uses_focus
from ragsnap.compression.propagate import propagation_of
from ragsnap.prompt.focus import prompt_focus
from ragsnap.prompt.structure import prompt_roles
from ragsnap.runtime.blend import DEFAULT_SELECTION
from ragsnap.runtime.kv import cache_nbytes
from ragsnap.runtime.loading.models import LoadedModel
from ragsnap.runtime.prefill import PrefillResult, tail_start
from ragsnap.runtime.tails import Tail

if TYPE_CHECKING:
    from ragsnap.prompt.assembly import PromptLayout

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


def _remember(seen: OrderedDict[EntryKey, None], key: EntryKey) -> None:
    """Record ``key`` as the most recent of ``seen`` (the oldest past ``SEEN_PREFIXES`` go)."""
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > SEEN_PREFIXES:
        seen.popitem(last=False)


class PrefillRunner(DocumentRunner, Protocol):
    """What the tiers need of the model: a (chunked, cancellable) prefill and caches."""

    def prefill(
        self,
        input_ids: Sequence[int],
        press: Press,
        *,
        cache: Any | None = None,
        start: int = 0,
        on_chunk: Callable[[], None] | None = None,
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
    ) -> PrefillResult: ...

    def prefill_prompt(
        self,
        layout: PromptLayout,
        press: Press,
        *,
        on_chunk: Callable[[], None] | None = None,
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
    ) -> PrefillResult: ...

    def prefill_full(
        self, input_ids: Sequence[int], on_chunk: Callable[[], None] | None = None
    ) -> Layers: ...

    def cache_from(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any: ...

    def tails_batchable(self, tails: Sequence[Tail]) -> bool: ...

    def prefill_tails(self, tails: Sequence[Tail]) -> list[PrefillResult]: ...


@dataclass
class PrefixHit:
    """A prompt whose document prefix was loaded: only ``tail`` is left to finish
    (:meth:`CachedPrefill.finish_prefix_hits`), then stored under ``key``."""

    tail: Tail
    key: EntryKey
    report: CacheReport


class CachedPrefill:
    """Prefill through a :class:`KVStore` around ``runner`` on the ``loaded`` model."""

    def __init__(
        self,
        runner: PrefillRunner,
        loaded: LoadedModel,
        store: KVStore,
        *,
        prefix_cache: bool = True,
        prefix_store: str = "recurring",
        storage_dtype: torch.dtype | None = None,
        document_cache: bool = False,
        recompute_share: float = DEFAULT_RECOMPUTE_SHARE,
        recompute_select: str = DEFAULT_SELECTION,
        prefix_memory_bytes: int = DEFAULT_PREFIX_MEMORY_BYTES,
        unwritten_bytes: int = DEFAULT_UNWRITTEN_BYTES,
        hit_memory_bytes: int = DEFAULT_HIT_MEMORY_BYTES,
    ) -> None:
        """``prefix_store``: when a computed document prefix is written to the store,
        ``recurring`` (once its document set recurs; the first time it stays in this
        process's prefix memory only) or ``always``. ``document_cache`` keeps each
        document's KV for prompts that combine them anew,
        recomputing ``recompute_share`` of their tokens (0: plain concatenation), chosen
        per ``recompute_select`` (see :func:`ragsnap.runtime.blend.blend_prefix`);
        ``prefix_memory_bytes`` of the most recently used document prefixes stay in this
        process's memory in front of the store (:mod:`ragsnap.cache.tiers.prefix_memory`);
        compressed entries wait for their write after the answer in up to
        ``unwritten_bytes`` of memory (:mod:`ragsnap.cache.tiers.unwritten`); the most recently
        read or written ones stay loaded in up to ``hit_memory_bytes``
        (:mod:`ragsnap.cache.tiers.hit_memory`)."""
        self.runner = runner
        self.loaded = loaded
        self.store = store
        if prefix_store not in ("recurring", "always"):
            raise ValueError(f"prefix_store must be recurring or always, got {prefix_store!r}")
        self.prefix_cache = prefix_cache
        self.prefix_store = prefix_store
        self.storage_dtype = storage_dtype
        self.memory = PrefixMemory(prefix_memory_bytes if prefix_cache else 0)
        self.unwritten = UnwrittenEntries(unwritten_bytes)
        self.hits = HitMemory(hit_memory_bytes)
        self.documents = (
            DocumentTier(self, runner, recompute_share, recompute_select)
            if document_cache
            else None
        )
        # document prefixes computed here before (see _first_sight and _recurs)
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
        return (
            None if self.storage_dtype is None else str(self.storage_dtype).removeprefix("torch.")
        )

    def entry_keys(
        self, layout: PromptLayout, press: Press, question: str, namespace: str | None
    ) -> tuple[EntryKey, EntryKey]:
        """The compressed-entry key and the prefix-entry key of this prompt."""
        model = self.model_identity()
        doc_hashes = [d.content_hash for d in layout.documents]
        compressed = keys.compressed_key(
            namespace,
            model=model,
            template_version=layout.template_version,
            press_config=press.config(),
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
            storage_dtype=self.storage_label(),
        )
        return compressed, prefix

    def prefix_start(self, layout: PromptLayout, press: Press) -> int:
        """Where the final forward pass starts when the prefix is reused; 0 = no reuse."""
        reuse = self.prefix_cache or self.documents is not None
        return tail_start(layout, press) if reuse else 0

    # -- the request ------------------------------------------------------------------

    def prefill(
        self,
        layout: PromptLayout,
        press: Press,
        question: str,
        namespace: str | None,
        on_chunk: Callable[[], None] | None = None,
    ) -> tuple[PrefillResult, CacheReport]:
        """The prompt's compressed cache, from the store when possible; store errors never raise.

        ``on_chunk`` runs between prefill chunks (see :func:`ragsnap.runtime.prefill.prefill`)."""
        report = CacheReport(status="miss")
        ckey, pkey = self.entry_keys(layout, press, question, namespace)
        loaded = self._load_compressed(ckey, report)
        if loaded is not None:
            return loaded, report
        if report.status == "unavailable":
            return self._compute(layout, press, pkey, report, False, on_chunk, namespace), report
        with self.store.exclusive(ckey, wait_s=FLIGHT_WAIT_S):
            loaded = self._load_compressed(ckey, report)  # another request computed it meanwhile
            if loaded is not None:
                return loaded, report
            storing = report.status != "unavailable"
            result = self._compute(layout, press, pkey, report, storing, on_chunk, namespace)
            if storing:
                self._put_later(ckey, result, report)
        return result, report

    def finish(self, report: CacheReport) -> None:
        """Write what was left for after the answer (its compressed entry, a miss's prefix
        entry); a second call writes nothing."""
        pending, report.pending = report.pending, []
        for key, payload in pending:
            counted = CacheReport(status=report.status)  # its bytes were counted when queued
            written = report.status != "unavailable" and self._put(key, payload, counted)
            report.status = counted.status
            if written and key.kind == KIND_COMPRESSED:
                self._deserialize(key, payload())  # the next hit, from memory
            self.unwritten.written(key)

    def lookup(
        self, layout: PromptLayout, press: Press, question: str, namespace: str | None
    ) -> tuple[PrefillResult | PrefixHit | None, CacheReport]:
        """An exact hit's result, a prefix hit to finish, or None (:meth:`prefill` computes
        it); nothing is computed here and store errors never raise."""
        report = CacheReport(status="miss")
        ckey, pkey = self.entry_keys(layout, press, question, namespace)
        loaded = self._load_compressed(ckey, report)
        if loaded is not None or report.status == "unavailable" or not self.prefix_cache:
            return loaded, report
        start = self.prefix_start(layout, press)
        tail = Tail(layout.input_ids, [], start, press)
        if start <= 0 or not self.runner.tails_batchable([tail]):
            return None, report
        prefix = self._load_prefix(pkey, layout, report)
        if prefix is None:
            return None, report
        report.status, report.tier = "prefix-hit", "prefix"
        focus = prompt_focus(self.loaded.tokenizer, layout) if uses_focus(press) else None
        tail = dataclasses.replace(
            tail, prefix=prefix, roles=prompt_roles(self.loaded.tokenizer, layout), focus=focus
        )
        return PrefixHit(tail, ckey, report), report

    def finish_prefix_hits(self, hits: Sequence[PrefixHit]) -> list[PrefillResult]:
        """Finish ``hits`` in shared passes and store each compressed entry (one result per
        hit; hits of the same entry share one). An entry another request stored meanwhile
        is loaded instead."""
        unique = list({hit.key: hit for hit in hits}.values())
        results: dict[EntryKey, PrefillResult] = {}
        with self.store.exclusive_many([hit.key for hit in unique], wait_s=FLIGHT_WAIT_S):
            todo = []
            for hit in unique:
                stored = self._load_compressed(hit.key, hit.report)
                if stored is not None:
                    results[hit.key] = stored
                else:
                    todo.append(hit)
            tails = [hit.tail for hit in todo]
            groups = [tails] if self.runner.tails_batchable(tails) else [[t] for t in tails]
            computed = [r for group in groups if group for r in self.runner.prefill_tails(group)]
            for hit, result in zip(todo, computed, strict=True):
                results[hit.key] = result
                if hit.report.status != "unavailable":
                    self._put_later(hit.key, result, hit.report)
        return [results[hit.key] for hit in hits]

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

    def _put(self, key: EntryKey, payload: Callable[[], bytes], report: CacheReport) -> bool:
        """Write ``payload`` under ``key``; whether the store took it."""
        try:
            data = payload()
            if self.store.put(key, data):
                report.bytes_written += len(data)
                return True
        except StoreUnavailable as exc:
            logger.warning("cache unavailable, entry not stored: %s", exc)
            report.status = "unavailable"
        except Exception:
            logger.exception("cache write failed for %s; the answer goes on", key.digest[:12])
        return False

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

    def _load_compressed(self, key: EntryKey, report: CacheReport) -> PrefillResult | None:
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
        cache = self.runner.cache_from(stored.layers)
        report.status, report.tier = "hit", "exact"
        report.load_s += time.perf_counter() - started
        return PrefillResult(
            cache=cache,
            original_length=stored.original_length,
            next_logits=stored.next_logits,
            kept=stored.kept,
            press_config=stored.press_config,
            prefill_s=0.0,
            compress_s=0.0,
            kv_bytes_full=stored.kv_bytes_full,
            kv_bytes_kept=cache_nbytes(cache),
            processed_tokens=0,
            bias=stored.decode_bias,
            draft=stored.draft,
        )

    def _deserialize(self, key: EntryKey, payload: bytes) -> StoredPrefill | None:
        """``payload`` loaded and remembered in :attr:`hits`; None (and the entry dropped)
        when it does not load."""
        try:
            stored = deserialize_prefill(payload, **self.entry_identity())
            self.runner.cache_from(stored.layers)  # the model's layer layout, or a miss here
        except Exception as exc:  # any entry that does not load is a miss, never a 500
            self.drop_entry(key, exc)
            return None
        self.hits.put(key, stored)
        return stored

    # -- prefix hit and miss ----------------------------------------------------------

    def _compute(
        self,
        layout: PromptLayout,
        press: Press,
        pkey: EntryKey,
        report: CacheReport,
        store: bool,
        on_chunk: Callable[[], None] | None,
        namespace: str | None = None,
    ) -> PrefillResult:
        start = self.prefix_start(layout, press)
        roles = prompt_roles(self.loaded.tokenizer, layout)
        focus = prompt_focus(self.loaded.tokenizer, layout) if uses_focus(press) else None
        report.tier = "cold"
        if start <= 0:
            return self.runner.prefill_prompt(
                layout, press, on_chunk=on_chunk, roles=roles, focus=focus
            )
        prefix_s, prefix_tokens = 0.0, 0  # the document-prefix pass, when this request runs it
        prefix = self._load_prefix(pkey, layout, report) if store and self.prefix_cache else None
        if prefix is not None:
            report.status, report.tier = "prefix-hit", "prefix"
        elif store and self.documents is not None:
            assembled = self.documents.assemble(layout, namespace, report)
            if assembled is not None:
                report.status, report.tier = "document-hit", "documents"
                report.recomputed_tokens = assembled.recomputed
                prefix, prefix_s, prefix_tokens = (
                    assembled.layers,
                    assembled.seconds,
                    assembled.recomputed,
                )
        if prefix is None and self._first_sight(pkey, press):
            # query-aware prefill needs no full document KV: a document set seen for the
            # first time takes it (no prefix entry); one that recurs gets the full prefill
            # and its prefix entry, so its later requests are prefix hits
            return self.runner.prefill_prompt(
                layout, press, on_chunk=on_chunk, roles=roles, focus=focus
            )
        if prefix is None:
            prefix_started = time.perf_counter()
            prefix = self.runner.prefill_full(layout.input_ids[: layout.prefix_len], on_chunk)
            prefix_s, prefix_tokens = time.perf_counter() - prefix_started, layout.prefix_len
            if store and self.prefix_cache:
                kept = self.memory.put(pkey, self._as_stored(prefix))
                if self.prefix_store == "always" or not kept or self._recurs(pkey):
                    self._write_prefix(pkey, prefix, layout, report)
                else:  # seen once: the memory serves it, written if the set recurs
                    _remember(self.memory_only, pkey)
        with torch.inference_mode():
            cropped = [(k[:, :, :start], v[:, :, :start]) for k, v in prefix]
        result = self.runner.prefill(
            layout.input_ids,
            press,
            cache=self.runner.cache_from(cropped),
            start=start,
            on_chunk=on_chunk,
            roles=roles,
            focus=focus,
        )
        result.prefill_s += prefix_s  # the figures cover both passes of a miss
        result.processed_tokens += prefix_tokens
        return result

    def _first_sight(self, pkey: EntryKey, press: Press) -> bool:
        """Whether ``press`` propagates and this is the first time its prefix is computed
        here (then it is remembered: the next time is a recurrence)."""
        if propagation_of(press) is None or not press.window_only:
            return False
        return not self._recurs(pkey)

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
        report.bytes_written += self.stored_bytes(prefix)

    def _prefix_payload(self, prefix: Layers, layout: PromptLayout) -> Callable[[], bytes]:
        loaded = self.loaded
        return lambda: serialize_prefix(
            prefix,
            prefix_len=layout.prefix_len,
            model_id=loaded.model_id,
            revision=loaded.revision,
            storage_dtype=self.storage_dtype,
        )

    def stored_bytes(self, layers: Layers) -> int:
        """The tensor bytes of ``layers`` in the storage dtype (what a prefix or document
        entry holds)."""
        size = self.storage_dtype.itemsize if self.storage_dtype is not None else None
        scales = 4 if self.storage_dtype == torch.int8 else 0  # a float32 scale per vector
        return sum(
            (k.numel() + v.numel()) * (size or k.element_size())
            + (k.numel() // k.shape[-1] + v.numel() // v.shape[-1]) * scales
            for k, v in layers
        )

    def _as_stored(self, layers: Layers) -> Layers:
        """``layers`` as a load from the store returns them (rounded to the storage dtype)."""
        if self.storage_dtype is None:
            return layers
        with torch.inference_mode():
            if self.storage_dtype == torch.int8:
                return [(int8_kv.round_trip(k), int8_kv.round_trip(v)) for k, v in layers]
            return [
                (k.to(self.storage_dtype).to(k.dtype), v.to(self.storage_dtype).to(v.dtype))
                for k, v in layers
            ]

    def _load_prefix(
        self, key: EntryKey, layout: PromptLayout, report: CacheReport
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        started = time.perf_counter()
        kept = self.memory.get(key)
        if kept is not None:
            report.load_s += time.perf_counter() - started
            if key in self.memory_only:  # its document set recurs: now it is written
                self._write_prefix(key, kept, layout, report)
            return kept
        payload = self.read_entry(key, report)
        if payload is None:
            return None
        try:
            layers = deserialize_prefix(
                payload, prefix_len=layout.prefix_len, **self.entry_identity()
            )
            self.runner.cache_from(layers)  # the model's layer layout, or a miss here
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
