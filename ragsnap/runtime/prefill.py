"""Prefill with presses: chunked, cancellable between chunks, compressed once at the end.

SnapKV-style presses vote with the queries of the last ``window`` prompt tokens, so the
last chunk always covers the window; earlier chunks only append full KV. Presses that need
every prompt query (``window_only = False``, e.g. H2O) prefill in one pass.

Each prefill is a generator of :class:`ChunkStep` (:func:`prefill_steps`,
:func:`prefill_full_steps`): it yields before every chunk it computes, so whoever drives it
(the engine's in-process path drains it, the scheduler interleaves it with decode steps)
decides what runs between two chunks, may compute a chunk itself in another pass
(:attr:`ChunkStep.done`), or stops the prefill by closing the generator, leaving the model
free after at most one chunk. A prefill whose press still drafts and compresses after its
last chunk yields :class:`PromptLogits` first, so the driver can send the first token
before that work, then each pass of the draft (:class:`DraftChunk`), which the driver may
compute in its own pass. :func:`drain` runs one to its end with an ``on_chunk`` callback
between chunks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragsnap.compression import CompressedLayer, Press, compression_hooks
from ragsnap.compression.hooks import query_capture
from ragsnap.compression.lookahead import lookahead_tokens
from ragsnap.compression.propagate import budget_need, propagation_of, voting_parameters
from ragsnap.runtime.drafts import Drafts
from ragsnap.runtime.forward import DraftPass
from ragsnap.runtime.kv import cache_nbytes, derive_cache, sliding_windows
from ragsnap.runtime.llama_pass import ChunkFeed, LlamaPass, computes_chunks, llama_pass_for
from ragsnap.runtime.loading.bf16_matmuls import medium_products
from ragsnap.runtime.propagation import LayerSplit, select_tokens
from ragsnap.runtime.reserved_cache import reserved

if TYPE_CHECKING:
    from ragsnap.prompt.assembly import PromptLayout


# why a press that asked for a query-aware prefill took the full path on a prefix hit
PREFIX_LOADED = "the document prefix was loaded: only the tail is computed"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class PrefillResult:
    """A prompt after prefill and compression, ready to decode from.

    ``cache`` holds the kept entries (``[1, Hkv, n_layer, D]`` per layer); decoding
    continues at position ``original_length``. ``kept[i]`` is what the press kept of
    compressed layer ``i`` (original positions in ``kept[i].indices``, ``[1, Hkv, n_layer]``).
    """

    cache: Any
    original_length: int
    next_logits: torch.Tensor  # [1, V]
    kept: list[CompressedLayer]
    press_config: dict[str, Any]
    prefill_s: float
    compress_s: float
    kv_bytes_full: int
    kv_bytes_kept: int
    processed_tokens: int
    # layer -> [1, Hkv, n] logit bias of the kept keys (Attention Matching); empty = none
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    # the answer's first tokens, drafted greedily on the full cache to vote (LookaheadPress)
    draft: list[int] = field(default_factory=list)
    # which prefill served: "full", or "propagate" (query-aware: layers >= propagate_layer
    # ran over propagated_tokens of the prompt only); full_path_reason says why a press
    # that asked for propagation took the full path
    prefill_path: str = "full"
    propagate_layer: int | None = None
    propagated_tokens: int | None = None
    full_path_reason: str | None = None

    @property
    def drafted_tokens(self) -> int:
        return len(self.draft)

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(keys, values)`` per layer, ``[1, Hkv, n_l, D]``."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    @property
    def kept_tokens_per_layer(self) -> list[int]:
        return [layer.indices.shape[-1] for layer in self.kept]

    @property
    def kept_tokens(self) -> int:
        """Kept entries per KV head, averaged over compressed layers (rounded)."""
        per_layer = self.kept_tokens_per_layer
        return round(sum(per_layer) / len(per_layer)) if per_layer else self.original_length

    def keep_rate(self) -> torch.Tensor:
        """``[L]``: share of (compressed layer, KV head) pairs that kept each prompt position."""
        counts = torch.zeros(self.original_length)
        total = 0
        for layer in self.kept:
            idx = layer.indices[0].cpu()  # [Hkv, n]
            counts += torch.bincount(idx.flatten(), minlength=self.original_length).float()
            total += idx.shape[0]
        return counts / max(total, 1)


def chunk_starts(start: int, length: int, chunk: int | None, window: int) -> list[int]:
    """Where each chunk of positions ``[start, length)`` begins; the last covers ``window``."""
    if chunk is None or chunk <= 0 or length - start <= chunk:
        return [start]
    cuts = list(range(start, length, chunk))
    last = max(start, min(cuts[-1], length - window))
    return [c for c in cuts if c < last] + [last]


def window_floor(press: Press | None) -> int:
    """Positions the final forward pass must cover for ``press`` (its observation window)."""
    return max(1, int(getattr(press, "window", 1) or 1))


def tail_start(layout: PromptLayout, press: Press) -> int:
    """Where a prompt's tail starts: the first position a prefix hit computes (the question,
    the generation prompt, and enough of the documents' end for ``press``'s window); 0 when
    ``press`` needs every query or the prompt has no documents."""
    if not press.window_only or not layout.documents:
        return 0
    return max(0, min(layout.prefix_len, layout.num_tokens - window_floor(press)))


@torch.inference_mode()
def forward_chunk(
    model: Any, cache_kwarg: str, token_ids: Sequence[int], cache: Any, start: int
) -> torch.Tensor:
    """Run ``token_ids`` at positions ``start..`` on top of ``cache``; last logits ``[1, V]``."""
    return forward_tokens(model, cache_kwarg, token_ids, cache, start, keep=1)


@torch.inference_mode()
def forward_tokens(
    model: Any, cache_kwarg: str, token_ids: Sequence[int], cache: Any, start: int, keep: int
) -> torch.Tensor:
    """:func:`forward_chunk` returning the logits of the last ``keep`` positions ``[keep, V]``."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    positions = torch.arange(start, start + ids.shape[1], device=device).unsqueeze(0)
    out = model(
        input_ids=ids,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=keep,
        **{cache_kwarg: cache},
    )
    return out.logits[0]


def chunk_pass(model: Any) -> LlamaPass | None:
    """The lean pass that computes ``model``'s prompt chunks when no hook watches them
    (:meth:`~ragsnap.runtime.llama_pass.LlamaPass.chunk`), or None (module tree)."""
    lean = llama_pass_for(model)
    return lean if lean is not None and computes_chunks(model) else None


def compute_chunk(model: Any, cache_kwarg: str, lean: LlamaPass | None, step: ChunkStep) -> None:
    """``step``'s chunk into its cache, through ``lean`` where given (no logits needed)."""
    if lean is not None:
        lean.chunk(ChunkFeed(step.ids, step.cache, step.begin))
    else:
        forward_chunk(model, cache_kwarg, step.ids, step.cache, step.begin)


@dataclass
class ChunkStep:
    """A chunk a prefill is about to compute: ``ids`` at positions ``begin ..`` into
    ``cache``. When ``ridable``, the driver may compute it itself in the same pass as other
    work (the scheduler's decode step, :class:`~ragsnap.runtime.llama_pass.ChunkFeed`) and
    set ``done``; the prefill then skips it. ``tokens`` is what the prefill has left."""

    ids: Sequence[int]
    cache: Any
    begin: int
    ridable: bool
    tokens: int
    done: bool = False


@dataclass
class PromptLogits:
    """The prompts' last logits ``[B, V]`` (one row per prompt), yielded by a prefill as
    soon as they exist, before its draft and compression: a driver may send each prompt's
    first token then. Nothing is to be computed for it; the next ``next()`` goes on."""

    logits: torch.Tensor


@dataclass
class DraftChunk:
    """A pass of a prompt's lookahead draft about to run (:func:`draft_queries`): ``ids``
    at positions ``begin ..`` on top of ``cache``. Its driver may compute it in the same
    pass as other work (the scheduler's decode step, a
    :class:`~ragsnap.runtime.llama_pass.ChunkFeed` with ``queries``) when ``ridable`` and
    set ``logits`` (``[n, V]``, every position's), the queries recorded into ``queries``
    (layer -> one ``[1, Hq, n, D]``); else the draft computes it itself when it goes on.
    Not ridable where a layer's cache holds fewer entries than positions (a query-aware
    prefill keeps only the propagated tokens past its split): the lean pass attends by
    position."""

    ids: list[int]
    cache: Any
    begin: int
    ridable: bool = True
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    logits: torch.Tensor | None = None


# what a prefill yields, and a prefill as its driver sees it: steps out, its result at the end
Step = ChunkStep | PromptLogits | DraftPass | DraftChunk
Steps = Generator[Step, None, Any]


class ChunkRider(Protocol):
    """An ``on_chunk`` callback of :func:`drain` that can also compute a chunk itself:
    ``ride(ids, cache, begin)`` computes ``ids`` at positions ``begin ..`` into ``cache`` in
    the same pass as other work and says whether it did; ``on_chunk()`` still runs after
    the chunk."""

    def __call__(self) -> None: ...

    def ride(self, ids: Sequence[int], cache: Any, begin: int) -> bool: ...


def drain(steps: Steps, on_chunk: Callable[[], None] | None = None) -> Any:
    """Run ``steps`` to its end, ``on_chunk()`` after every chunk but the last (a
    :class:`ChunkRider` may compute a ridable chunk itself); an exception from
    ``on_chunk`` closes the prefill and propagates. Returns the prefill's result."""
    ride = getattr(on_chunk, "ride", None)
    first = True
    try:
        while True:
            try:
                step = next(steps)
            except StopIteration as finished:
                return finished.value
            if not isinstance(step, ChunkStep):  # logits to see, or a draft pass it runs itself
                continue
            if not first and on_chunk is not None:
                on_chunk()
            first = False
            if step.ridable and ride is not None:
                step.done = bool(ride(step.ids, step.cache, step.begin))
    finally:
        steps.close()


@torch.inference_mode()
def draft_queries(
    model: Any,
    cache_kwarg: str,
    cache: Any,
    logits: torch.Tensor,
    position: int,
    tokens: int,
    stop_ids: Collection[int],
    context: Sequence[int] = (),
) -> Generator[DraftChunk, None, tuple[dict[int, torch.Tensor], list[int]]]:
    """Greedily draft up to ``tokens`` tokens after a prompt of ``position`` tokens held in
    ``cache`` (``logits``: ``[1, V]`` at its last position), appending their KV, and stop
    before an end-of-turn token (``stop_ids``). Returns, per layer, the drafted tokens'
    queries ``[1, Hq, k, D]`` (empty when the first token ends the turn), and the tokens.

    ``context`` (the prompt's ids): an answer copies names and phrases from its documents,
    so each pass feeds the next token with a guess at those after it (what followed the
    draft's last tokens in the prompt, :class:`~ragsnap.runtime.drafts.Drafts`) and keeps
    the guessed tokens greedy decoding picks itself; the rest of the guess is cut from the
    cache and the queries. The draft is the one of one-token passes, in fewer passes.

    A generator: each pass is yielded before it runs (:class:`DraftChunk`: its driver may
    compute it beside other rows); one its driver left uncomputed runs here, in the lean
    pass where :func:`chunk_pass` gives one, else through the module tree (its queries
    recorded by :func:`query_capture`). A pass is a few tokens over the whole prompt,
    weight-bound on a CPU."""
    drafted: list[int] = []
    guesses = Drafts(context, stop_ids) if context else None
    ridable = all(cache.get_seq_length(i) == position for i in range(len(cache.layers)))
    lean = chunk_pass(model) if ridable else None
    captured: dict[int, list[torch.Tensor]] = {}
    while len(drafted) < tokens:
        token = int(logits[0].argmax())
        if token in stop_ids:
            break
        drafted.append(token)
        guess: list[int] = []
        if guesses is not None:
            guesses.extend([token])
            guess = guesses.draft(tokens - len(drafted))
        fed = [token, *guess]
        step = DraftChunk(fed, cache, position + len(drafted) - 1, ridable)
        yield step
        if step.logits is None and lean is not None:
            feed = ChunkFeed(fed, cache, step.begin, queries=step.queries)
            lean.chunk(feed)
            step.logits = feed.logits
        elif step.logits is None:
            with query_capture(model) as own:
                step.logits = forward_tokens(model, cache_kwarg, fed, cache, step.begin, len(fed))
            step.queries = own
        out = step.logits
        assert out is not None, "a draft pass left without logits"
        picks = out.argmax(dim=-1).tolist()  # picks[j]: greedy's token after fed[j]
        kept = 0
        while kept < len(guess) and picks[kept] == guess[kept]:
            kept += 1
        if kept < len(guess):  # the unconfirmed guesses leave the cache
            cache.crop(kept - len(guess))
        for layer, queries in step.queries.items():  # and the queries
            captured.setdefault(layer, []).append(queries[-1][:, :, : 1 + kept])
        drafted.extend(guess[:kept])
        if guesses is not None:
            guesses.extend(guess[:kept])
        logits = out[kept : kept + 1]
    return {layer: torch.cat(queries, dim=2) for layer, queries in captured.items()}, drafted


def prefill(
    *args: Any, on_chunk: Callable[[], None] | None = None, **options: Any
) -> list[PrefillResult]:
    """:func:`prefill_steps` (same arguments) drained, ``on_chunk`` between chunks (see
    :func:`drain`)."""
    results: list[PrefillResult] = drain(prefill_steps(*args, **options), on_chunk)
    return results


def prefill_steps(
    model: Any,
    cache_kwarg: str,
    input_ids: Sequence[int],
    presses: Press | Sequence[Press],
    *,
    cache: Any,
    start: int = 0,
    chunk: int | None = None,
    word_starts: torch.Tensor | None = None,
    roles: torch.Tensor | None = None,
    focus: torch.Tensor | None = None,
    stop_ids: Collection[int] = (),
    forced: torch.Tensor | None = None,
) -> Generator[Step, None, list[PrefillResult]]:
    """Prefill ``input_ids[start:]`` on top of ``cache`` (holding the first ``start``
    positions) in chunks of ``chunk`` tokens, and compress every layer at the end; yields
    a :class:`ChunkStep` before each chunk (see the module docstring),
    :class:`PromptLogits` once the last chunk's logits exist, and a :class:`DraftChunk`
    before each pass of a lookahead draft.

    One press compresses ``cache`` in place; several presses leave it full and each result
    gets its own derived cache (prefill attention is full whatever the press, so each keeps
    what a prefill of its own would keep).
    When a press looks ahead (:class:`~ragsnap.compression.lookahead.LookaheadPress`), the
    last chunk only keeps each layer's input for the window, the first answer tokens are
    drafted on the full cache (stopping at ``stop_ids``), the cache is cut back to the
    prompt, and then every layer is compressed with the drafted queries voting too.

    A press wrapped in :class:`~ragsnap.compression.propagate.PropagatePress` takes the
    query-aware path (:mod:`ragsnap.runtime.propagation`) where it applies
    (:func:`propagation_plan`): ``forced`` (``[L]`` bool) marks positions that always
    propagate (the instruction, the document headers; the window always does).
    """
    press_list = [presses] if isinstance(presses, Press) else list(presses)
    device = next(model.parameters()).device
    single = len(press_list) == 1
    window = max(window_floor(p) for p in press_list)
    every_query = not all(p.window_only for p in press_list)
    if every_query:
        chunk = None  # the press needs every prompt query at once
    starts = chunk_starts(start, len(input_ids), chunk, window)
    # a sliding layer's cache cannot be cut back after a draft
    ahead = 0 if any(sliding_windows(model.config)) else lookahead_tokens(*press_list)
    drafted: dict[int, torch.Tensor] | None = None
    draft: list[int] = []
    split, share, reason = propagation_plan(model, cache_kwarg, press_list, start)
    positions: torch.Tensor | None = None
    length = len(input_ids)
    lean = chunk_pass(model)
    _sync(device)
    started = time.perf_counter()
    with reserved(cache, length + ahead), split.installed() if split else contextlib.nullcontext():
        for begin, end in zip(starts, starts[1:], strict=False):
            step = ChunkStep(input_ids[begin:end], cache, begin, split is None, length - begin)
            yield step
            if split is not None:
                split.lower(step.ids, cache, begin)
            elif not step.done:
                compute_chunk(model, cache_kwarg, lean, step)
        yield ChunkStep(input_ids[starts[-1] :], cache, starts[-1], False, length - starts[-1])
        hooks = compression_hooks(
            model,
            press_list,
            apply=single,
            word_starts=word_starts,
            roles=roles,
            focus=focus,
            deferred=bool(ahead),
            keep_rows=None if every_query else window,
        )
        with hooks as recorder:
            recorder.armed = True
            if split is None:
                logits = forward_chunk(
                    model, cache_kwarg, input_ids[starts[-1] :], cache, starts[-1]
                )
            else:
                press = press_list[0]
                split.lower(input_ids[starts[-1] :], cache, starts[-1], voting_parameters(press))
                assert split.votes is not None, "the vote hook did not run"
                need = budget_need(press, length)
                keep = split.propagated_count(length, share, need)
                if forced is None:
                    forced = torch.zeros(length, dtype=torch.bool)
                positions = select_tokens(split.votes, length, keep, forced)
                for layer in range(split.layer, len(split.layers)):
                    recorder.positions[layer] = positions
                logits = yield from _upper_passes(split, positions, cache, chunk, window, recorder)
            recorder.armed = False
            if ahead:  # the draft and the compression are still to come
                yield PromptLogits(logits)
                drafted, draft = yield from draft_queries(
                    model, cache_kwarg, cache, logits, len(input_ids), ahead, stop_ids, input_ids
                )
                cache.crop(len(input_ids) - cache.get_seq_length())
                recorder.compress_pending(cache, drafted or None)
    _sync(device)
    prefill_s = time.perf_counter() - started
    results = []
    for i, press in enumerate(press_list):
        kept_cache = cache if single else derive_cache(cache, recorder.results[i])
        results.append(
            PrefillResult(
                cache=kept_cache,
                original_length=len(input_ids),
                next_logits=logits,
                kept=recorder.layer_results(i),
                bias=recorder.layer_bias(i),
                press_config=press.config(),
                prefill_s=prefill_s,
                compress_s=recorder.seconds if single else recorder.press_seconds[i],
                kv_bytes_full=recorder.bytes_seen,
                kv_bytes_kept=cache_nbytes(kept_cache),
                processed_tokens=len(input_ids) - start,
                draft=list(draft),
                prefill_path="full" if positions is None else "propagate",
                propagate_layer=None if split is None else split.layer,
                propagated_tokens=None if positions is None else int(positions.shape[0]),
                full_path_reason=reason,
            )
        )
    return results


def propagation_plan(
    model: Any, cache_kwarg: str, presses: Sequence[Press], start: int
) -> tuple[LayerSplit | None, float, str | None]:
    """The layer split of a query-aware prefill, its share ``p``, and why not (None, 1.0,
    the reason) when a press asked for it but the full path runs; (None, 1.0, None) when no
    press asked. Raises :class:`ConfigError` for ``s`` or ``p`` out of range."""
    asked = [propagation_of(p) for p in presses]
    wrapper = asked[0] if len(asked) == 1 else None
    if not any(asked):
        return None, 1.0, None
    if wrapper is None:
        return None, 1.0, "several presses share one prefill"
    resolved = wrapper.resolve(model.config)
    if not presses[0].window_only:
        return None, 1.0, f"press {presses[0].name!r} needs every prompt query"
    if start > 0:
        return None, 1.0, PREFIX_LOADED
    split = LayerSplit(model, cache_kwarg, resolved.layer)
    if split.upper_slides and resolved.share < 1.0:
        return None, 1.0, "a sliding-window layer past the split needs contiguous positions"
    return split, resolved.share, None


def _upper_passes(
    split: LayerSplit,
    positions: torch.Tensor,
    cache: Any,
    chunk: int | None,
    window: int,
    recorder: Any,
) -> Generator[ChunkStep, None, torch.Tensor]:
    """The propagated tokens through the upper layers in chunks (one pass where an upper
    layer slides), the recorder armed for the last; a step before each but the first."""
    count = int(positions.shape[0])
    hidden = split.gathered(positions)
    starts = chunk_starts(0, count, None if split.upper_slides else chunk, window)
    logits = torch.empty(0)
    for begin, end in zip(starts, [*starts[1:], count], strict=True):
        if begin > 0:
            yield ChunkStep((), cache, begin, False, count - begin)
        recorder.armed = end == count
        logits = split.upper(hidden, positions, cache, begin, end)
    return logits


def prefill_full(
    model: Any,
    cache_kwarg: str,
    input_ids: Sequence[int],
    cache: Any,
    *,
    chunk: int | None = None,
    on_chunk: Callable[[], None] | None = None,
) -> None:
    """:func:`prefill_full_steps` drained (``on_chunk`` between chunks, see :func:`drain`)."""
    drain(prefill_full_steps(model, cache_kwarg, input_ids, cache, chunk=chunk), on_chunk)


def prefill_full_steps(
    model: Any, cache_kwarg: str, input_ids: Sequence[int], cache: Any, *, chunk: int | None = None
) -> Generator[ChunkStep, None, None]:
    """Full KV of ``input_ids`` into ``cache`` (no press, no logits), chunked, a ridable
    step before each chunk. The pass over a document prefix: it runs inside
    :func:`~ragsnap.runtime.loading.bf16_matmuls.medium_products` (in the lean pass where
    nothing rounds to bfloat16, :func:`chunk_pass`)."""
    starts = chunk_starts(0, len(input_ids), chunk, 1)
    length = len(input_ids)
    lean = chunk_pass(model)
    with reserved(cache, length):
        for begin, end in zip(starts, [*starts[1:], length], strict=True):
            step = ChunkStep(input_ids[begin:end], cache, begin, True, length - begin)
            yield step
            if not step.done:
                with medium_products():
                    compute_chunk(model, cache_kwarg, lean, step)
