"""What the cache tiers did for one answer (shared by the tiers and the engine)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ragsnap.cache.backends.store import EntryKey


@dataclass
class CacheReport:
    """What the cache did for one answer; ``status`` is off|miss|hit|prefix-hit|document-hit|
    unavailable. ``tier`` names what served the prefill (exact|prefix|documents|cold|off)."""

    status: str = "off"
    tier: str = "off"
    reused_documents: int = 0  # document pieces loaded from the per-document tier
    recomputed_tokens: int = 0  # prompt tokens of an assembled prefix run with full context
    reuse_note: str | None = None  # why the per-document tier was not used, when it was not
    bytes_read: int = 0
    # entries this answer stores, counted when they are serialized or queued: the deferred
    # writes (after the answer, :meth:`CachedPrefill.finish`) included, so the answer's
    # statistics show them; an entry the store then refuses is still counted
    bytes_written: int = 0
    load_s: float = 0.0
    pending: list[tuple[EntryKey, Callable[[], bytes]]] = field(default_factory=list, repr=False)
