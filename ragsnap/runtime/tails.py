"""Batched tails: prompts whose document prefix is cached, finished together.

A prefix hit only prefills its tail (the question and the generation prompt) on top of its
loaded prefix, drafts the first answer tokens (lookahead presses) and compresses. Several
prefix hits waiting together share those passes: each is a row of one
:class:`~ragsnap.runtime.forward.BatchedKV` holding its own prefix, every row feeds the
same number of tail tokens (a shorter tail starts earlier and recomputes the last prefix
positions, whose KV it already had), the draft runs as one-token passes over all rows, and
then each row is compressed on its own cache with its own press and observation window,
exactly as :func:`ragsnap.runtime.prefill.prefill` compresses one prompt. On a 2-core CPU a
prefix hit is mostly passes of a few tokens each, which cost about as much for 8 rows as
for one (the weights are read once per pass).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Generator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ragsnap.compression import Press, compression_hooks
from ragsnap.compression.hooks import CompressionRecorder, attention_modules, query_capture
from ragsnap.compression.lookahead import lookahead_tokens
from ragsnap.compression.propagate import propagation_of
from ragsnap.runtime.decode import DRAFT_PASS_TOKENS
from ragsnap.runtime.drafts import Drafts
from ragsnap.runtime.forward import BatchedKV, DraftPass, forward_rows
from ragsnap.runtime.kv import cache_from_layers, cache_nbytes, sliding_windows
from ragsnap.runtime.llama_pass import LlamaPass
from ragsnap.runtime.prefill import (
    PREFIX_LOADED,
    PrefillResult,
    PromptLogits,
    window_floor,
)

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Tail:
    """One prompt to finish: ``input_ids``, whose first ``start`` positions ``prefix`` holds
    (``[1, Hkv, >= start, D]`` per layer), compressed by ``press``. ``word_starts``,
    ``roles`` and ``focus`` (``[L]`` each) describe its positions to the press."""

    input_ids: Sequence[int]
    prefix: Layers
    start: int
    press: Press
    word_starts: torch.Tensor | None = None
    roles: torch.Tensor | None = None
    focus: torch.Tensor | None = None


def batchable(model: Any, tails: Sequence[Tail]) -> bool:
    """Whether ``tails`` can be finished together: a model without sliding-window layers
    (their caches cannot be cut back after a draft), presses that vote with their window
    only, and every prompt at least as long as the longest tail."""
    if any(sliding_windows(model.config)) or not tails:
        return False
    longest = max(len(t.input_ids) - t.start for t in tails)
    return all(t.press.window_only and len(t.input_ids) >= longest for t in tails)


def prefill_tails_steps(
    model: Any,
    cache_kwarg: str,
    tails: Sequence[Tail],
    stop_ids: Collection[int] = (),
    scratch: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    workers: Executor | None = None,
    lean: LlamaPass | None = None,
) -> Generator[PromptLogits | DraftPass, None, list[PrefillResult]]:
    """Prefill, draft and compress every tail of ``tails`` (see the module docstring); one
    result per tail, as ``prefill(input_ids, press, cache=prefix, start=start)`` gives it
    (up to float noise). A generator: it yields the tails' last logits
    (:class:`PromptLogits`, ``[B, V]``) after their shared pass, then, with ``lean``, each
    draft pass before it runs (:class:`DraftPass`: its driver may compute it beside other
    rows), before the compression (:func:`~ragsnap.runtime.prefill.drain` runs it
    through). ``prefill_s`` is the batch's shared time plus the row's compression;
    ``stop_ids`` end a draft.
    ``scratch`` is batch memory to reuse (see :meth:`BatchedKV.of_rows`): no result refers
    to it. ``workers`` compress the rows in parallel (each row is independent once the
    shared passes are done); None: in turn. ``lean`` (the model's
    :class:`~ragsnap.runtime.llama_pass.LlamaPass`) runs the draft's passes.

    Raises ValueError when the tails are not :func:`batchable`.
    """
    if not batchable(model, tails):
        raise ValueError("these tails cannot be finished in one batch")
    length = max(len(t.input_ids) - t.start for t in tails)
    starts = [len(t.input_ids) - length for t in tails]
    ahead = [lookahead_tokens(t.press) for t in tails]
    batch = BatchedKV.of_rows(
        sliding_windows(model.config),
        [
            [(k[:, :, :s], v[:, :, :s]) for k, v in t.prefix]
            for t, s in zip(tails, starts, strict=True)
        ],
        starts,
        # a row feeds a token to every draft pass, its own draft over or not, and rows
        # are padded to the pass's longest feed: up to twice the longest draft past the
        # longest prompt, and a decode step's longest feed where one runs the pass
        # (growing 8 rows of 3.4K tokens took 0.5-1 s)
        reserve=length + 2 * max(ahead) + DRAFT_PASS_TOKENS,
        scratch=scratch,
    )
    started = time.perf_counter()
    keep = max(window_floor(t.press) for t in tails)
    # one deferred recorder keeps every layer's input rows for the windows (all batch rows)
    with compression_hooks(model, tails[0].press, deferred=True, keep_rows=keep) as inputs:
        inputs.armed = True
        logits = forward_rows(
            model,
            cache_kwarg,
            batch,
            [t.input_ids[s:] for t, s in zip(tails, starts, strict=True)],
            last=True,
        )
        inputs.armed = False
    yield PromptLogits(logits)
    drafted, drafts = yield from draft_rows(
        model, cache_kwarg, batch, logits, ahead, stop_ids, [t.input_ids for t in tails], lean
    )
    prefill_s = time.perf_counter() - started
    modules = attention_modules(model)

    def compressed(r: int) -> PrefillResult:
        tail = tails[r]
        prompt = len(tail.input_ids)
        cache = cache_from_layers(
            model.config, [(k[:, :, :prompt], v[:, :, :prompt]) for k, v in batch.row_layers(r)]
        )
        recorder = CompressionRecorder(
            [tail.press],
            apply=True,
            num_layers=len(modules),
            word_starts=tail.word_starts,
            roles=tail.roles,
            focus=tail.focus,
        )
        window = window_floor(tail.press)
        for layer, (module, hidden, (cos, sin)) in inputs.pending.items():
            rows = slice(r, r + 1)
            recorder.pending[layer] = (
                module,
                hidden[rows, -window:],
                (cos[rows, -window:], sin[rows, -window:]),
            )
        k = len(drafts[r])
        with torch.inference_mode():
            recorder.compress_pending(
                cache, {layer: q[r : r + 1, :, :k] for layer, q in drafted.items()} if k else None
            )
        for layer in cache.layers:  # what a press kept whole is still a view of the batch
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
        return PrefillResult(
            cache=cache,
            original_length=prompt,
            next_logits=logits[r : r + 1],
            kept=recorder.layer_results(0),
            bias=recorder.layer_bias(0),
            press_config=tail.press.config(),
            prefill_s=prefill_s + recorder.seconds,
            compress_s=recorder.seconds,
            kv_bytes_full=recorder.bytes_seen,
            kv_bytes_kept=cache_nbytes(cache),
            processed_tokens=prompt - starts[r],
            draft=drafts[r],
            full_path_reason=PREFIX_LOADED if propagation_of(tail.press) is not None else None,
        )

    rows = range(len(tails))
    return list(map(compressed, rows) if workers is None else workers.map(compressed, rows))


@torch.inference_mode()
def draft_rows(
    model: Any,
    cache_kwarg: str,
    batch: BatchedKV,
    logits: torch.Tensor,
    limits: Sequence[int],
    stop_ids: Collection[int],
    contexts: Sequence[Sequence[int]] = (),
    lean: LlamaPass | None = None,
) -> Generator[DraftPass, None, tuple[dict[int, torch.Tensor], list[list[int]]]]:
    """Greedily draft up to ``limits[r]`` tokens after each row of ``batch`` (``logits``:
    ``[B, V]`` at each row's last position), appending their KV, stopping a row before an
    end-of-turn token. Returns, per layer, the drafted tokens' queries ``[B, Hq, k, D]``
    (row ``r``'s first ``len(drafts[r])`` are its own), and each row's tokens.

    ``contexts[r]`` (row ``r``'s prompt ids): each pass feeds a row's token with a guess
    at the next ones from its prompt's n-grams and keeps the guesses greedy confirms, as
    :func:`~ragsnap.runtime.prefill.draft_queries` does; the rest leave the row's cache.
    A row that stopped still feeds a token to the passes of the others; what it appends
    lies past its draft and is never read.

    ``lean``: the passes skip transformers' module tree and record the queries
    themselves, and each is yielded before it runs (:class:`DraftPass`); one its driver
    left uncomputed runs here. Each pass is a few tokens per row over every row's whole
    prompt, weight-bound on a CPU (8 rows of 3.4K tokens: 0.19 s a pass on 2 threads with
    the module tree's masked sdpa): in a decode step's pass its weights are read once for
    both."""
    rows = len(limits)
    drafts: list[list[int]] = [[] for _ in limits]
    guesses = [Drafts(c, stop_ids) for c in contexts] if contexts else None
    drafting = [limit > 0 for limit in limits]
    # per row and layer, the queries of its kept tokens, pass after pass ([1, Hq, k, D])
    kept_queries: list[dict[int, list[torch.Tensor]]] = [{} for _ in limits]
    capture: contextlib.AbstractContextManager[dict[int, list[torch.Tensor]]] = (
        query_capture(model) if lean is None else contextlib.nullcontext({})
    )
    with capture as captured:
        while True:
            fed: list[list[int]] = []
            guessed: list[list[int] | None] = []  # None: the row drafts no more
            for r, row_logits in enumerate(logits):
                token = int(row_logits.argmax())
                if drafting[r] and len(drafts[r]) < limits[r] and token not in stop_ids:
                    drafts[r].append(token)
                    guess: list[int] = []
                    if guesses is not None:
                        guesses[r].extend([token])
                        guess = guesses[r].draft(limits[r] - len(drafts[r]))
                    fed.append([token, *guess])
                    guessed.append(guess)
                else:
                    drafting[r] = False
                    fed.append([drafts[r][-1] if drafts[r] else token])
                    guessed.append(None)
            if not any(drafting):
                break
            if lean is None:
                out = forward_rows(model, cache_kwarg, batch, fed, last=False)  # [B, q, V]
            else:
                step = DraftPass(batch, fed, captured)
                yield step
                out = (
                    step.logits
                    if step.logits is not None
                    else forward_rows(
                        model, cache_kwarg, batch, fed, last=False, lean=lean, queries=captured
                    )
                )
            next_logits = []
            for r, row_guess in enumerate(guessed):
                kept = 0
                if row_guess is not None:
                    picks = out[r, : len(fed[r])].argmax(dim=-1).tolist()
                    while kept < len(row_guess) and picks[kept] == row_guess[kept]:
                        kept += 1
                    batch.retract(r, len(row_guess) - kept)
                    drafts[r].extend(row_guess[:kept])
                    if guesses is not None:
                        guesses[r].extend(row_guess[:kept])
                    for layer, queries in captured.items():
                        kept_queries[r].setdefault(layer, []).append(
                            queries[-1][r : r + 1, :, : 1 + kept]
                        )
                next_logits.append(out[r, kept])
            logits = torch.stack(next_logits)
    most = max((len(d) for d in drafts), default=0)
    out_queries = {}
    for layer, queries in captured.items():
        empty = queries[0][:1, :, :0]
        per_row = []
        for r in range(rows):
            own = torch.cat(kept_queries[r].get(layer, [empty]), dim=2)
            per_row.append(F.pad(own, (0, 0, 0, most - own.shape[2])))
        out_queries[layer] = torch.cat(per_row)
    return out_queries, drafts
