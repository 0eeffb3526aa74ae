"""The per-document tier: each document's KV stored once, reused in any combination and order.

A prompt's document ``i`` is the tokens of ``[n] title\\ntext``. Its ``[n]`` label changes
with the order, so the stored piece is the rest, the body, as it tokenizes in this prompt
(the key holds the body's token digest: a tokenizer that merged label and body would give
another key, a miss, never a wrong piece). The body is computed once right after the
prompt head at positions ``head_len ..`` and stored full (compression happens after
assembly, with this prompt's question). Assembly re-encodes each piece to its place and
recomputes the labels and ``share`` of the body tokens with the full context (see
:mod:`ragsnap.runtime.blend`); the tail then prefills on top with the press, as after a
prefix hit. Entries share the store, serialization, TTL, eviction and damage handling of
the other tiers; they are keyed without the question, the press or the other documents,
within the namespace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragsnap.cache import keys
from ragsnap.cache.backends.store import EntryKey
from ragsnap.cache.report import CacheReport
from ragsnap.cache.serialization import KIND_DOCUMENT, deserialize_prefix, serialize_prefix
from ragsnap.prompt.assembly import encode_user_text
from ragsnap.runtime.blend import DEFAULT_SELECTION, SELECTIONS, BlendResult, PlacedPiece

if TYPE_CHECKING:
    from ragsnap.prompt.assembly import PromptLayout
    from ragsnap.runtime.loading.models import LoadedModel

logger = logging.getLogger(__name__)

Layers = list[tuple[torch.Tensor, torch.Tensor]]
# assemble when at least this share of the documents comes from the tier (the rest is
# computed alone on the spot); below it a cold prefill is cheaper than pieces + recompute
MIN_REUSED_SHARE = 0.5
# CacheBlend's share: on 12 held-out items (60+ of HotpotQA and BioASQ factoid) the first
# share whose KL to the cold answer is under a third of plain concatenation's with the
# question selection (0.285; 0.12 gave 0.346), at 3.58x the cold first token (AMD EPYC,
# float32, 1 thread; on a Xeon with AMX in bfloat16 about 2.35x). issue 44, docs/results.md
# "Reuse on by default (issue 44, session 26)"
DEFAULT_RECOMPUTE_SHARE = 0.15


class TierOwner(Protocol):
    """What the per-document tier uses of the tiers around it (:class:`CachedPrefill`)."""

    loaded: LoadedModel
    runner: Any
    storage_dtype: torch.dtype | None

    def read_entry(self, key: EntryKey, report: CacheReport) -> bytes | None: ...
    def drop_entry(self, key: EntryKey, reason: Exception) -> None: ...
    def model_identity(self) -> dict[str, str]: ...
    def storage_label(self) -> str | None: ...
    def entry_identity(self) -> dict[str, Any]: ...
    def stored_bytes(self, layers: Layers) -> int: ...


class DocumentRunner(Protocol):
    """What the tier needs of the model (``ModelRuntime`` provides it)."""

    def blend_support(self) -> str | None: ...

    def head_kv(self, head_ids: Sequence[int]) -> Layers: ...

    def document_pieces(
        self, head_ids: Sequence[int], bodies: Sequence[Sequence[int]], head: Layers | None = ...
    ) -> list[Layers]: ...

    def blend_prefix(
        self,
        prefix_ids: Sequence[int],
        head_len: int,
        pieces: Sequence[PlacedPiece],
        share: float,
        select: str = ...,
        probe_ids: Sequence[int] = ...,
        head: Layers | None = ...,
    ) -> BlendResult: ...


@dataclass(frozen=True)
class DocumentSlot:
    """Where document ``index``'s body sits in a prompt and the key of its piece."""

    index: int
    key: EntryKey
    start: int  # prompt position of the body's first token (after the label)
    body: tuple[int, ...]


@dataclass
class Assembled:
    """A prefix built from pieces: KV ``[1, Hkv, prefix_len, D]`` per layer."""

    layers: Layers
    reused: int  # documents whose piece came from the store
    recomputed: int  # prompt positions run with the full context (labels, chosen, missing)
    seconds: float


class DocumentTier:
    """Per-document pieces of ``owner``'s store (its get/put/drop never raise)."""

    def __init__(
        self,
        owner: TierOwner,
        runner: DocumentRunner,
        share: float,
        select: str = DEFAULT_SELECTION,
    ) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the recompute share must be in [0, 1], got {share}")
        if select not in SELECTIONS:
            raise ValueError(f"unknown recompute selection {select!r}; one of {SELECTIONS}")
        self.owner, self.runner, self.share, self.select = owner, runner, share, select
        # the last prompt head's KV: every prompt of a template starts with the same head
        self._head: tuple[tuple[int, ...], Layers] | None = None

    def head(self, head_ids: Sequence[int]) -> Layers:
        """The KV of ``head_ids``, computed once per distinct head (one forward saved)."""
        kept, ids = self._head, tuple(head_ids)
        if kept is not None and kept[0] == ids:
            return kept[1]
        layers = self.runner.head_kv(ids)
        self._head = (ids, layers)  # one assignment: a concurrent reader sees old or new
        return layers

    def slots(self, layout: PromptLayout, namespace: str | None) -> list[DocumentSlot | None]:
        """Per document, its slot; None where its label does not tokenize apart from the body."""
        tokenizer = self.owner.loaded.tokenizer
        head = layout.input_ids[: layout.doc_spans[0][0]] if layout.doc_spans else []
        model = self.owner.model_identity()
        out: list[DocumentSlot | None] = []
        for i, (document, (start, end)) in enumerate(
            zip(layout.documents, layout.doc_spans, strict=True)
        ):
            label = encode_user_text(tokenizer, f"[{i + 1}]")
            piece = layout.input_ids[start:end]
            if piece[: len(label)] != label or len(piece) <= len(label):
                out.append(None)
                continue
            body = tuple(piece[len(label) :])
            key = keys.document_key(
                namespace,
                model=model,
                template_version=layout.template_version,
                doc_hash=document.content_hash,
                head_ids=head,
                body_ids=body,
                storage_dtype=self.owner.storage_label(),
            )
            out.append(DocumentSlot(i, key, start + len(label), body))
        return out

    def assemble(
        self, layout: PromptLayout, namespace: str | None, report: CacheReport
    ) -> Assembled | None:
        """The prompt's document prefix from the tier, or None (then prefill cold; the
        pieces this prompt lacked are left in ``report.pending`` to store after the answer)."""
        reason = self.runner.blend_support()
        if reason is not None:
            report.reuse_note = reason
            return None
        started = time.perf_counter()
        slots = self.slots(layout, namespace)
        found: dict[int, Layers] = {}
        for slot in slots:
            if slot is None:
                continue
            layers = self._load(slot, report)
            if report.status == "unavailable":
                return None
            if layers is not None:
                found[slot.index] = layers
        usable = [s for s in slots if s is not None]
        missing = [s for s in usable if s.index not in found]
        if len(found) < MIN_REUSED_SHARE * len(layout.documents):
            self._queue(layout, missing, report)
            return None
        head_len = layout.doc_spans[0][0]
        head = layout.input_ids[:head_len]
        head_layers = self.head(head)
        computed = (
            self.runner.document_pieces(head, [s.body for s in missing], head_layers)
            if missing
            else []
        )
        for slot, layers in zip(missing, computed, strict=True):
            found[slot.index] = layers
            report.pending.append((slot.key, self._payload(slot, _constant(layers))))
        self._count_written(missing, head_layers, report)
        placed = [PlacedPiece(found[s.index], head_len, s.start) for s in usable]
        blend = self.runner.blend_prefix(
            layout.input_ids[: layout.prefix_len],
            head_len,
            placed,
            self.share,
            self.select,
            layout.input_ids[layout.prefix_len :],
            head_layers,
        )
        report.reused_documents = len(found) - len(missing)
        return Assembled(
            layers=blend.layers,
            reused=report.reused_documents,
            recomputed=len(blend.recomputed) + sum(len(s.body) for s in missing),
            seconds=time.perf_counter() - started,
        )

    def _load(self, slot: DocumentSlot, report: CacheReport) -> Layers | None:
        owner, started = self.owner, time.perf_counter()
        payload = owner.read_entry(slot.key, report)
        if payload is None:
            return None
        try:
            layers = deserialize_prefix(
                payload, prefix_len=len(slot.body), kind=KIND_DOCUMENT, **owner.entry_identity()
            )
            owner.runner.cache_from(layers)  # the model's layer layout, or a miss here
        except Exception as exc:  # any entry that does not load is a miss, never a 500
            owner.drop_entry(slot.key, exc)
            return None
        report.bytes_read += len(payload)
        report.load_s += time.perf_counter() - started
        return layers

    def queue_all(self, layout: PromptLayout, namespace: str | None, report: CacheReport) -> None:
        """After a cold prefill the tier was not asked about: store every piece later."""
        if self.runner.blend_support() is None:
            self._queue(layout, [s for s in self.slots(layout, namespace) if s], report)

    def _queue(
        self, layout: PromptLayout, missing: Sequence[DocumentSlot], report: CacheReport
    ) -> None:
        """Leave the pieces of ``missing`` to compute and store after the answer: one extra
        forward of their bodies after the head (no cross-document attention), off the TTFT."""
        if not missing:
            return
        head = layout.input_ids[: layout.doc_spans[0][0]]
        computed: list[Layers] = []

        def pieces() -> list[Layers]:
            if not computed:  # one pass for all of them, on the first write
                bodies = [s.body for s in missing]
                computed.extend(self.runner.document_pieces(head, bodies, self.head(head)))
            return computed

        for i, slot in enumerate(missing):
            report.pending.append((slot.key, self._payload(slot, _item(pieces, i))))
        self._count_written(missing, self.head(head), report)

    def _count_written(
        self, slots: Sequence[DocumentSlot], head: Layers, report: CacheReport
    ) -> None:
        """Add the stored bytes of ``slots``' pieces to ``report`` before they are computed:
        a piece holds per token what the head's KV (``[1, Hkv, h, D]`` per layer) does."""
        per_token = self.owner.stored_bytes(head) / head[0][0].shape[2]
        report.bytes_written += round(per_token * sum(len(s.body) for s in slots))

    def _payload(self, slot: DocumentSlot, layers: Callable[[], Layers]) -> Callable[[], bytes]:
        loaded, dtype = self.owner.loaded, self.owner.storage_dtype

        def serialize() -> bytes:
            return serialize_prefix(
                layers(),
                prefix_len=len(slot.body),
                model_id=loaded.model_id,
                revision=loaded.revision,
                storage_dtype=dtype,
                kind=KIND_DOCUMENT,
            )

        return serialize


def _constant(layers: Layers) -> Callable[[], Layers]:
    return lambda: layers


def _item(pieces: Callable[[], list[Layers]], i: int) -> Callable[[], Layers]:
    return lambda: pieces()[i]


__all__ = ["DEFAULT_RECOMPUTE_SHARE", "Assembled", "DocumentSlot", "DocumentTier"]
