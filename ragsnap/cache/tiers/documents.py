"""The per-document tier: each document's KV reused in any combination and order.

A prompt's document ``i`` is the tokens of ``[n] title\\ntext``. Its ``[n]`` label changes
with the order, so a piece is the rest, the body, as it tokenizes in this prompt (the key
holds the body's token digest: a tokenizer that merged label and body would give another
key, a miss, never a wrong piece). A piece is not computed on its own: when a cold prompt's
document prefix is written, each of its documents gets a small entry pointing into it
(the prefix's key, where the body starts, its length). So a miss pays no second pass and
writes its documents' KV once, in its prefix entry; a later prompt that combines documents
anew loads the prefixes its pieces point into (each once, through the prefix memory) and
cuts the bodies out. A body so cut was computed after the documents before it in its first
prompt; the engine re-encodes it to its new place and recomputes the labels, the documents
no piece covers and a share of the body tokens with the full context
(:mod:`ragsnap.runtime.blend`). Pointers are keyed without the question, the press or the
other documents, within the namespace; a pointer whose prefix is gone, damaged or of
another length is a miss (and deleted).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragsnap.cache import keys
from ragsnap.cache.backends.store import EntryKey
from ragsnap.cache.report import CacheReport
from ragsnap.cache.serialization import FORMAT_VERSION, KIND_DOCUMENT, KIND_PREFIX, StaleEntry
from ragsnap.cache.tiers.plans import Cold, DocumentHit, FoundPiece
from ragsnap.prompt.assembly import encode_user_text

if TYPE_CHECKING:
    from ragsnap.prompt.assembly import PromptLayout
    from ragsnap.runtime.loading.models import LoadedModel

logger = logging.getLogger(__name__)

Layers = list[tuple[torch.Tensor, torch.Tensor]]
# assemble when at least this share of the documents comes from the tier (the rest is
# recomputed with the full context); below it a cold prefill is cheaper
MIN_REUSED_SHARE = 0.5


class TierOwner(Protocol):
    """What the per-document tier uses of the tiers around it (:class:`CachedPrefill`)."""

    loaded: LoadedModel
    store: Any

    def read_entry(self, key: EntryKey, report: CacheReport) -> bytes | None: ...
    def drop_entry(self, key: EntryKey, reason: Exception) -> None: ...
    def model_identity(self) -> dict[str, str]: ...
    def prefix_label(self) -> str | None: ...
    def load_prefix_entry(
        self, key: EntryKey, prefix_len: int, report: CacheReport
    ) -> Layers | None: ...


@dataclass(frozen=True)
class DocumentSlot:
    """Where document ``index``'s body sits in a prompt and the key of its piece."""

    index: int
    key: EntryKey
    start: int  # prompt position of the body's first token (after the label)
    body: tuple[int, ...]


def pointer_payload(slot: DocumentSlot, prefix: EntryKey, prefix_len: int, model_id: str) -> bytes:
    """The entry of ``slot``'s piece: its body at ``slot.start`` of the prefix ``prefix``."""
    return json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "kind": KIND_DOCUMENT,
            "model_id": model_id,
            "prefix": prefix.digest,
            "prefix_len": prefix_len,
            "start": slot.start,
            "length": len(slot.body),
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def read_pointer(payload: bytes, slot: DocumentSlot, model_id: str) -> tuple[str, int, int]:
    """``(prefix digest, prefix length, body start)`` of a piece's entry; raises
    :class:`StaleEntry` for anything else (another format, model or body length)."""
    try:
        data = json.loads(payload)
        digest, prefix_len, start = str(data["prefix"]), int(data["prefix_len"]), int(data["start"])
        ok = (
            data["format_version"] == FORMAT_VERSION
            and data["kind"] == KIND_DOCUMENT
            and data["model_id"] == model_id
            and int(data["length"]) == len(slot.body)
            and len(digest) == 64
            and 0 < start <= prefix_len - len(slot.body)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise StaleEntry(f"unreadable piece entry: {exc}") from exc
    if not ok:
        raise StaleEntry("a piece entry of another format, model or length")
    return digest, prefix_len, start


class DocumentTier:
    """Per-document pieces of ``owner``'s store (its get/put/drop never raise);
    ``blend_reason``: why the model cannot assemble a prefix from pieces (None: it can)."""

    def __init__(self, owner: TierOwner, blend_reason: str | None = None) -> None:
        self.owner, self.blend_reason = owner, blend_reason

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
                storage_dtype=self.owner.prefix_label(),
            )
            out.append(DocumentSlot(i, key, start + len(label), body))
        return out

    def find(
        self, layout: PromptLayout, namespace: str | None, report: CacheReport
    ) -> list[FoundPiece] | None:
        """The pieces the tier holds for ``layout``'s documents, or None when they are too
        few (or the model cannot assemble them): then the prompt is computed cold."""
        if self.blend_reason is not None:
            report.reuse_note = self.blend_reason
            return None
        if not layout.documents:
            return None
        started = time.perf_counter()
        found: list[FoundPiece] = []
        prefixes: dict[str, Layers | None] = {}
        for slot in self.slots(layout, namespace):
            if slot is None:
                continue
            piece = self._load(slot, prefixes, report)
            if report.status == "unavailable":
                return None
            if piece is not None:
                found.append(piece)
        if len(found) < MIN_REUSED_SHARE * len(layout.documents):
            return None
        report.reused_documents = len(found)
        report.load_s += time.perf_counter() - started
        return found

    def _load(
        self, slot: DocumentSlot, prefixes: dict[str, Layers | None], report: CacheReport
    ) -> FoundPiece | None:
        owner = self.owner
        payload = owner.read_entry(slot.key, report)
        if payload is None:
            return None
        try:
            digest, prefix_len, start = read_pointer(payload, slot, owner.loaded.model_id)
        except StaleEntry as exc:
            owner.drop_entry(slot.key, exc)
            return None
        report.bytes_read += len(payload)
        if digest not in prefixes:
            prefix_key = EntryKey(slot.key.namespace, KIND_PREFIX, digest)
            prefixes[digest] = owner.load_prefix_entry(prefix_key, prefix_len, report)
        layers = prefixes[digest]
        if layers is None:  # its prefix is gone: so is the piece
            owner.drop_entry(slot.key, StaleEntry("the piece's prefix is gone"))
            return None
        end = start + len(slot.body)
        body = [(k[:, :, start:end], v[:, :, start:end]) for k, v in layers]
        return FoundPiece(body, start, slot.start)

    def new_slots(
        self, plan: Cold | DocumentHit, layout: PromptLayout, namespace: str | None
    ) -> list[DocumentSlot]:
        """The slots of ``layout`` whose pieces ``plan``'s prefix is the first to hold: every
        document of a cold prompt, the documents a document hit found no piece for."""
        if self.blend_reason is not None:
            return []
        slots = [s for s in self.slots(layout, namespace) if s is not None]
        if isinstance(plan, DocumentHit):
            found = {piece.start for piece in plan.pieces}
            slots = [s for s in slots if s.start not in found]
        return slots

    def point(
        self,
        slots: Sequence[DocumentSlot],
        prefix_len: int,
        prefix: EntryKey,
        report: CacheReport,
    ) -> None:
        """Leave, for after the answer, the pieces of ``slots`` as pointers into the
        document prefix of ``prefix_len`` tokens stored under ``prefix``."""
        model_id = self.owner.loaded.model_id
        for slot in slots:
            data = pointer_payload(slot, prefix, prefix_len, model_id)
            report.pending.append((slot.key, functools.partial(bytes, data)))
            report.bytes_written += len(data)


__all__ = ["MIN_REUSED_SHARE", "DocumentSlot", "DocumentTier"]
