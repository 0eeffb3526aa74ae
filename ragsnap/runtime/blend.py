"""Document prefixes assembled from per-document KV, with selective recompute (CacheBlend-like).

A document's piece is its body's KV computed once, right after the prompt head (so the
head, not the document's first token, is the attention sink it learned), at positions
``head_len ..``. For a new prompt, :func:`blend_prefix` places each piece at its position
(keys re-encoded by :mod:`ragsnap.runtime.reencode`), computes the head fresh, and then
recomputes a chosen set of tokens through every layer with the whole assembled context:
the tokens never cached (each document's ``[n]`` label, whose number depends on the order)
and a ``share`` of the body tokens: by default those the question (the prompt's tail) attends
to most over the assembled prefix (:mod:`ragsnap.runtime.blend_select`), or those whose
reused KV deviates most from a fresh computation at an early layer (CacheBlend, arXiv
2405.16444, picks by KV deviation at layer 1), or half by each. Each
recomputed token's new KV overwrites the reused one in every layer before attention runs,
so with ``share = 1`` every document token is recomputed: the cold prefix.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from ragsnap.runtime.attention import StepMask, step_masks
from ragsnap.runtime.blend_select import early_question_attention, question_attention
from ragsnap.runtime.kv import cache_from_layers, sliding_windows
from ragsnap.runtime.prefill import forward_chunk
from ragsnap.runtime.reencode import reencode_support, shift_layers

Layers = list[tuple[torch.Tensor, torch.Tensor]]
# the layer whose fresh-vs-reused KV deviation ranks tokens (CacheBlend uses the first
# layer after an attention pass: layer 0's KV depends on the token alone)
SELECT_LAYER = 1
# how the recomputed body tokens are chosen: by the question tail's attention over every
# layer or over the first layers only (blend_select; lower KL than deviation at the same
# share on the embedded model, see lab/results.md), by layer-SELECT_LAYER KV deviation
# (CacheBlend), or half by the question and half by deviation
SELECTIONS = ("question", "early-question", "deviation", "both", "leading")
# question (all layers): on 12 held-out items at share 0.12, KL 0.365 of plain
# concatenation's at 2.55x, against early-question's 0.431 at 2.76x (issue 44,
# lab/results.md, session 24)
DEFAULT_SELECTION: Final = "question"
# pieces cut from the prompts that first held them (ragsnap.cache.tiers.documents) already
# carry their context: plain concatenation (0: only the labels recomputed, no ranking pass)
# had KL 0.103 to the cold answer on items 1-10 of HotpotQA and BioASQ factoid, half of
# what share 0.15 of pieces computed alone gave (0.199), at 2.4-2.7x the cold first token
# against 1.35-1.5x for 0.15 (KL 0.064); accuracy and citation F1 equal to cold's (Xeon AMX,
# bfloat16, 1 thread; issue 54, lab/results.md "Pieces from the prompt's own prefill")
DEFAULT_RECOMPUTE_SHARE = 0.0
# a question-driven selection always takes each piece's first LEAD_TOKENS body tokens (out
# of its share): a piece computed alone put an attention sink there, which the assembled
# prompt must not keep (EPIC, arXiv 2410.15332, recomputes each chunk's first tokens)
LEAD_TOKENS = 8


@dataclass(frozen=True)
class PlacedPiece:
    """A cached document body placed in a prompt: KV ``[1, Hkv, n, D]`` per layer, computed
    at positions ``base ..``, to sit at positions ``start .. start + n``."""

    layers: Layers
    base: int
    start: int

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[2])


@dataclass
class BlendResult:
    """The assembled prefix KV (``[1, Hkv, P, D]`` per layer) and what was recomputed."""

    layers: Layers
    recomputed: list[int]  # prompt positions recomputed with the full context
    selected: int  # of those, body tokens chosen by deviation


def blend_support(model: Any) -> str | None:
    """None when :func:`blend_prefix` covers ``model``, else why a cold prefill is needed."""
    reason = reencode_support(model)
    if reason is None and any(w is not None for w in sliding_windows(model.config)):
        # a sliding layer keeps only its window: a prefix assembled at full length is not its cache
        reason = "sliding-window attention layers are not assembled from pieces"
    return reason


class _StopForward(Exception):
    """Raised once the selection layer has written its KV: the rest of the pass is not needed."""


@torch.inference_mode()
def head_kv(model: Any, cache_kwarg: str, head_ids: Sequence[int]) -> Layers:
    """The prompt head's KV at positions ``0 ..``, ``[1, Hkv, len(head_ids), D]`` per layer
    (never changed in place by the functions here: a caller may keep and pass it again)."""
    head = model_cache(model)
    forward_chunk(model, cache_kwarg, head_ids, head, 0)
    return [(layer.keys, layer.values) for layer in head.layers]


@torch.inference_mode()
def document_pieces(
    model: Any,
    cache_kwarg: str,
    head_ids: Sequence[int],
    bodies: Sequence[Sequence[int]],
    head: Layers | None = None,
) -> list[Layers]:
    """Each body's KV computed after the head alone, ``[1, Hkv, n_i, D]`` per layer
    (``head``: :func:`head_kv` of ``head_ids`` when the caller has it)."""
    head_layers = head if head is not None else head_kv(model, cache_kwarg, head_ids)
    base = len(head_ids)
    pieces = []
    for body in bodies:
        cache = cache_from_layers(model.config, head_layers)  # appends copy, head stays intact
        forward_chunk(model, cache_kwarg, body, cache, base)
        pieces.append(
            [(layer.keys[:, :, base:], layer.values[:, :, base:]) for layer in cache.layers]
        )
    return pieces


def model_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _assemble(model: Any, head: Layers, pieces: Sequence[PlacedPiece], length: int) -> Layers:
    """Head KV then every piece re-encoded at its place; positions nothing fills stay zero."""
    out: Layers = []
    for i, (hk, hv) in enumerate(head):
        shape = (1, hk.shape[1], length, hk.shape[3])
        out.append((hk.new_zeros(shape), hv.new_zeros(shape)))
        out[i][0][:, :, : hk.shape[2]] = hk
        out[i][1][:, :, : hv.shape[2]] = hv
    for piece in pieces:
        moved = shift_layers(model, piece.layers, piece.start - piece.base)
        end = piece.start + piece.length
        for (k, v), (pk, pv) in zip(out, moved, strict=True):
            k[:, :, piece.start : end], v[:, :, piece.start : end] = pk, pv
    return out


def _fresh_select_layer(
    model: Any, cache_kwarg: str, prefix_ids: Sequence[int], head: Layers, head_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``SELECT_LAYER``'s KV of positions ``head_len ..`` computed with the full
    context (``[1, Hkv, P - head_len, D]`` each); the pass stops as soon as that layer's
    cache is written (about ``SELECT_LAYER + 0.2`` layers of a prefill)."""
    cache = cache_from_layers(model.config, head)
    layer = cache.layers[SELECT_LAYER]
    store = layer.update

    def update(*args: Any, **kwargs: Any) -> Any:
        store(*args, **kwargs)
        raise _StopForward  # the layer's KV is written: its attention and the rest are not needed

    layer.update = update  # this cache object only; the model is untouched
    try:
        forward_chunk(model, cache_kwarg, prefix_ids[head_len:], cache, head_len)
    except _StopForward:
        pass
    layer = cache.layers[SELECT_LAYER]
    return layer.keys[:, :, head_len:], layer.values[:, :, head_len:]


def deviation(
    fresh: tuple[torch.Tensor, torch.Tensor], reused: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``[n]``: squared distance of each token's reused keys and values from fresh ones,
    each relative to the fresh tensor's mean squared norm (keys and values weigh alike)."""
    total = torch.zeros(fresh[0].shape[2], device=fresh[0].device)
    for f, r in zip(fresh, reused, strict=True):
        diff = (f.float() - r.float()).pow(2).sum(dim=(0, 1, 3))
        total += diff / f.float().pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    return total


@functools.cache
def _scatter_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class ScatterLayer(DynamicLayer):  # type: ignore[misc]
        """A full-length layer whose ``update`` writes the new tokens' KV at their positions
        and returns the keys and values of positions ``[0, limit)`` (views)."""

        def __init__(
            self, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor, limit: int
        ) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values, self.at, self.limit = keys, values, at, limit

        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.keys.index_copy_(2, self.at, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, self.at, value_states.to(self.values.dtype))
            return self.keys[:, :, : self.limit], self.values[:, :, : self.limit]

    return ScatterLayer


# the recompute runs in position order in at most this many passes of at least
# BLOCK_MIN tokens: a pass's queries read keys only up to its last position, so the
# attention work falls from n x P towards n x P / 2, for one weight read per extra pass
RECOMPUTE_BLOCKS = 4
BLOCK_MIN = 128


def recompute_blocks(at: Sequence[int], blocks: int = RECOMPUTE_BLOCKS) -> list[list[int]]:
    """``at`` (sorted positions) cut into at most ``blocks`` runs of equal count, none
    shorter than ``BLOCK_MIN`` tokens (one run when ``at`` is short)."""
    count = max(1, min(blocks, len(at) // BLOCK_MIN))
    size = math.ceil(len(at) / count)
    return [list(at[i : i + size]) for i in range(0, len(at), size)]


@torch.inference_mode()
def recompute(
    model: Any, cache_kwarg: str, ids: Sequence[int], layers: Layers, at: list[int]
) -> None:
    """Rerun the tokens at positions ``at`` (sorted) through every layer on ``layers``
    (``[1, Hkv, P, D]``, changed in place): each sees every key at or before its position,
    the recomputed ones included. Runs in :func:`recompute_blocks` passes in position
    order, which gives what one pass would: a token never sees a later one."""
    from transformers import DynamicCache

    device = layers[0][0].device
    for block in recompute_blocks(at):
        index = torch.tensor(block, device=device)
        limit = block[-1] + 1
        cache = DynamicCache()
        cache.layers = [_scatter_layer_class()(k, v, index, limit) for k, v in layers]
        visible = torch.arange(limit, device=device).view(1, -1) <= index.view(-1, 1)  # [q, L]
        mask = torch.zeros(visible.shape, dtype=layers[0][0].dtype, device=device)
        mask = mask.masked_fill_(~visible, float("-inf")).view(1, 1, len(block), limit)
        step = StepMask(mask, (limit,))
        with step_masks(dict.fromkeys(range(len(layers)), step)):
            model(
                input_ids=torch.tensor([[ids[p] for p in block]], device=device),
                position_ids=index.view(1, -1),
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg: cache},
            )


def _by_deviation(
    model: Any,
    cache_kwarg: str,
    prefix_ids: Sequence[int],
    head: Layers,
    layers: Layers,
    head_len: int,
) -> torch.Tensor:
    """``[P]``: each position's layer-``SELECT_LAYER`` deviation (0 in the head)."""
    fresh = _fresh_select_layer(model, cache_kwarg, prefix_ids, head, head_len)
    k, v = layers[SELECT_LAYER]
    score = torch.zeros(len(prefix_ids))
    score[head_len:] = deviation(fresh, (k[:, :, head_len:], v[:, :, head_len:])).cpu()
    return score


def leading_positions(
    pieces: Sequence[PlacedPiece], head_len: int, tokens: int | None = None
) -> torch.Tensor:
    """``[m]`` long: the first ``tokens`` (None: ``LEAD_TOKENS``) positions of each piece (at
    or after ``head_len``), the pieces' first tokens first, so a short budget spreads over
    pieces."""
    order: list[int] = []
    for offset in range(LEAD_TOKENS if tokens is None else tokens):
        order += [
            p.start + offset for p in pieces if offset < p.length and p.start + offset >= head_len
        ]
    return torch.tensor(order, dtype=torch.long)


def _top(score: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` positions of ``candidates`` (``[n]`` long) with the highest ``score``."""
    return candidates[score[candidates].topk(min(count, len(candidates))).indices]


@torch.inference_mode()
def blend_prefix(
    model: Any,
    cache_kwarg: str,
    prefix_ids: Sequence[int],
    head_len: int,
    pieces: Sequence[PlacedPiece],
    share: float,
    select: str = DEFAULT_SELECTION,
    probe_ids: Sequence[int] = (),
    head: Layers | None = None,
) -> BlendResult:
    """The KV of ``prefix_ids`` (``[1, Hkv, P, D]`` per layer) from reused ``pieces``.

    Positions ``[0, head_len)`` are computed fresh; every position in ``[head_len, P)``
    that no piece covers is recomputed, and so is the top ``share`` of covered positions
    (all of them when ``share >= 1``), ranked per ``select``: ``"deviation"`` at layer
    ``SELECT_LAYER``, ``"question"`` by the attention ``probe_ids`` (the prompt's tail
    after the prefix) pay them over the assembled prefix (``"early-question"``: in its
    first layers only), ``"both"`` half by question and half by deviation, ``"leading"``
    each piece's first tokens alone (EPIC's static positions, arXiv 2410.15332: no pass
    ranks them). The question selections take each piece's leading tokens first
    (:func:`leading_positions`).
    Without ``probe_ids`` every selection ranks by deviation. ``head``: :func:`head_kv` of
    ``prefix_ids[:head_len]`` when the caller keeps it (one forward pass saved).
    """
    if select not in SELECTIONS:
        raise ValueError(f"unknown recompute selection {select!r}; one of {', '.join(SELECTIONS)}")
    if not probe_ids and select != "leading":
        select = "deviation"
    length = len(prefix_ids)
    head_layers = head if head is not None else head_kv(model, cache_kwarg, prefix_ids[:head_len])
    layers = _assemble(model, head_layers, pieces, length)
    covered = torch.zeros(length, dtype=torch.bool)
    for piece in pieces:
        covered[piece.start : piece.start + piece.length] = True
    covered[:head_len] = False
    body = covered.nonzero().flatten()
    redo = ~covered
    redo[:head_len] = False
    chosen = torch.zeros(length, dtype=torch.bool)
    count = min(len(body), math.ceil(share * len(body) - 1e-9)) if share > 0 else 0
    if count >= len(body):
        chosen[body] = True
    elif count > 0 and select == "leading":  # EPIC's static positions: no probe pass
        longest = max(piece.length for piece in pieces)
        chosen[leading_positions(pieces, head_len, longest)[:count]] = True
    elif count > 0:
        by_question = {"deviation": 0, "both": count // 2}.get(select, count)
        if by_question:
            chosen[leading_positions(pieces, head_len)[:by_question]] = True
            asked_for = by_question - int(chosen.sum())
            if asked_for > 0:
                probe = (
                    early_question_attention if select == "early-question" else question_attention
                )
                asked = probe(model, cache_kwarg, layers, probe_ids, redo)
                chosen[_top(asked, body[~chosen[body]], asked_for)] = True
        if by_question < count:
            score = _by_deviation(model, cache_kwarg, prefix_ids, head_layers, layers, head_len)
            rest = body[~chosen[body]]
            chosen[_top(score, rest, count - by_question)] = True
    at = (redo | chosen).nonzero().flatten().tolist()
    if at:
        recompute(model, cache_kwarg, prefix_ids, layers, at)
    return BlendResult(layers=layers, recomputed=at, selected=count)
