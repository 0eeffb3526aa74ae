"""What the cache tiers hold for a prompt, as data: the plan the engine executes.

:meth:`~ragsnap.cache.tiers.cached_prefill.CachedPrefill.plan` looks a prompt up and returns
one of four plans; it loads entries but computes nothing. The engine executes the plan with
the model (:mod:`ragsnap.engine.execute`) and hands what it computed back to the tiers to
store. One plan per kind of hit, so every entrance takes the same path for it:

``ExactHit``     the compressed entry: decode from it, no forward pass.
``PrefixHit``    the full KV of the document prefix: prefill the tail from ``split`` on it.
``DocumentHit``  the documents' pieces, placed: assemble the prefix recomputing a share of it
                 (:mod:`ragsnap.runtime.blend`), then prefill the tail as after a prefix hit.
``Cold``         nothing usable: prefill the prompt, the document prefix first when ``split``
                 is set (its KV then serves later questions), or whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ragsnap.cache.backends.store import EntryKey
from ragsnap.cache.report import CacheReport

if TYPE_CHECKING:
    from ragsnap.cache.serialization import StoredPrefill

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Lookup:
    """What a lookup needs besides the prompt: the press's config (part of the entry's
    key), the question and tenant, ``split`` (where a tail starts when the prefix is
    reused, 0: the prompt is computed whole) and whether the press prefills query-aware
    (``propagates``: a document set seen for the first time is then computed whole)."""

    press_config: dict[str, Any]
    question: str
    namespace: str | None
    split: int
    propagates: bool = False


@dataclass(frozen=True)
class FoundPiece:
    """A document body's stored KV (``[1, Hkv, n, D]`` per layer) computed at positions
    ``base ..``, to sit at prompt positions ``start ..``."""

    layers: Layers
    base: int
    start: int


@dataclass
class ExactHit:
    """The compressed entry under ``key`` was loaded."""

    key: EntryKey
    stored: StoredPrefill
    report: CacheReport


@dataclass
class PrefixHit:
    """The document prefix's full KV was loaded (``[1, Hkv, >= split, D]`` per layer):
    prefill the tail from ``split``, store the result under ``key``."""

    key: EntryKey
    prefix: Layers
    split: int
    report: CacheReport


@dataclass
class DocumentHit:
    """Enough of the documents' pieces were found: assemble the prefix (the prompt head
    ``[0, head_len)`` computed fresh, ``pieces`` placed, the rest recomputed), then prefill
    the tail from ``split``; ``prefix_key`` takes the assembled prefix."""

    key: EntryKey
    prefix_key: EntryKey
    split: int
    head_len: int
    pieces: list[FoundPiece]
    report: CacheReport


@dataclass
class Cold:
    """Nothing usable: compute the prompt (the document prefix first when ``split`` > 0),
    and store under ``key`` when ``storing`` (False: the store is unavailable)."""

    key: EntryKey
    prefix_key: EntryKey
    split: int
    storing: bool
    report: CacheReport
    notes: list[str] = field(default_factory=list)


Plan = ExactHit | PrefixHit | DocumentHit | Cold

__all__ = ["Cold", "DocumentHit", "ExactHit", "FoundPiece", "Lookup", "Plan", "PrefixHit"]
