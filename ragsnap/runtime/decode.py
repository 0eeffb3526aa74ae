"""The decode loop: rows with their own sampler, stop tokens, length and cancellation.

A :class:`DecodeBatch` holds any number of rows (requests) and advances all of them with
one model call per :meth:`DecodeBatch.step`. Rows join and leave between steps; a row's
tokens depend only on its own cache and sampler, never on the other rows (up to float
noise in the batched matmuls). One request decoding alone is a batch of one row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.compression.decode_snapkv import DecodeSnapKV, DecodeVotes
from ragsnap.generation import GenerationConfig, TokenSampler
from ragsnap.runtime.attention import observe_attention
from ragsnap.runtime.forward import BatchedKV, forward_rows
from ragsnap.runtime.prefill import PrefillResult

# spare cache entries a new row reserves per layer; a longer answer grows its buffers
RESERVE_TOKENS = 256

# (the row's tokens so far, its next-token logits [1, V]) -> logits to sample from
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class DecodeRow:
    """One request in a :class:`DecodeBatch`.

    ``next_logits`` (``[1, V]``) predict the row's next token; ``decode_s`` adds up the
    model steps this row took part in (its per-token latency, shared with its batch).
    ``logits_processor`` (optional) rewrites the row's logits before its sampler picks.
    ``votes`` (with decode-phase SnapKV) records its attention and bounds its cache.
    """

    key: Hashable
    generation: GenerationConfig
    sampler: TokenSampler
    next_logits: torch.Tensor
    should_stop: Callable[[list[int]], bool] | None = None
    logits_processor: LogitsProcessor | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    decode_s: float = 0.0
    steps: int = 0
    votes: DecodeVotes | None = None


@dataclass
class StepOutput:
    """What one step did for one row: its new token (None when it stopped on an
    end-of-turn token or was cancelled) and, when the row ended, why."""

    key: Hashable
    token: int | None
    finish_reason: str | None


class DecodeBatch:
    """Rows decoding together on one model (see the module docstring)."""

    def __init__(self, model: Any, cache_kwarg: str, windows: list[int | None], stop_ids: set[int]):
        self.model = model
        self.cache_kwarg = cache_kwarg
        self.stop_ids = stop_ids
        self.kv = BatchedKV(windows)
        self.rows: list[DecodeRow] = []
        self._cancelled: set[Hashable] = set()
        self.last_step_s = 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self,
        key: Hashable,
        prefill: PrefillResult,
        generation: GenerationConfig,
        should_stop: Callable[[list[int]], bool] | None = None,
        logits_processor: LogitsProcessor | None = None,
        decode_compression: DecodeSnapKV | None = None,
    ) -> DecodeRow:
        """A new row decoding from ``prefill``; it takes part from the next step on.

        ``logits_processor(tokens, logits)`` runs on the row's logits before each pick
        (e.g. a constraint that masks tokens with ``-inf``); it sees only its own row.
        ``decode_compression`` keeps the row's cache near its starting length per layer.

        The prefill's cache is copied into the batch, so ``prefill`` stays reusable.
        """
        device = prefill.next_logits.device
        row = DecodeRow(
            key=key,
            generation=generation,
            sampler=TokenSampler(generation, device),
            next_logits=prefill.next_logits,
            should_stop=should_stop,
            logits_processor=logits_processor,
        )
        if decode_compression is not None:
            targets = [k.shape[-2] for k, _ in prefill.layers]
            row.votes = DecodeVotes(decode_compression, targets)
        self.kv.add(
            prefill.layers,
            prefill.original_length,
            prefill.bias,
            reserve=min(generation.max_new_tokens, RESERVE_TOKENS),
        )
        self.rows.append(row)
        return row

    def cancel(self, key: Hashable) -> None:
        """Row ``key`` leaves at the next step (its last output has reason ``cancelled``)."""
        self._cancelled.add(key)

    def step(self) -> list[StepOutput]:
        """Pick every row's next token, retire finished rows, run one model call for the rest."""
        outputs: list[StepOutput] = []
        going: list[int] = []
        for index, row in enumerate(self.rows):
            token: int | None = None
            if row.key in self._cancelled:
                row.finish_reason = "cancelled"
            else:
                logits = row.next_logits
                if row.logits_processor is not None:
                    logits = row.logits_processor(row.tokens, logits)
                token = row.sampler(logits)
                if token in self.stop_ids:
                    token, row.finish_reason = None, "stop"
                else:
                    row.tokens.append(token)
                    if len(row.tokens) >= row.generation.max_new_tokens:
                        row.finish_reason = "length"
                    elif row.should_stop is not None and row.should_stop(row.tokens):
                        row.finish_reason = "stop"
            outputs.append(StepOutput(row.key, token, row.finish_reason))
            if row.finish_reason is None:
                going.append(index)
        self._cancelled.difference_update(o.key for o in outputs if o.finish_reason)
        if len(going) < len(self.rows):
            self.kv.keep(going)
            self.rows = [self.rows[i] for i in going]
        if self.rows:
            started = time.perf_counter()
            voting = [(r, row.votes) for r, row in enumerate(self.rows) if row.votes is not None]
            with observe_attention(self._recorder(voting)) if voting else nullcontext():
                logits = forward_rows(
                    self.model,
                    self.cache_kwarg,
                    self.kv,
                    [[r.tokens[-1]] for r in self.rows],
                    last=True,
                )
            self._reselect(voting)
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)
            self.last_step_s = time.perf_counter() - started
            for r, row in enumerate(self.rows):
                row.next_logits = logits[r : r + 1]
                row.decode_s += self.last_step_s
                row.steps += 1
        return outputs

    def _recorder(
        self, voting: list[tuple[int, DecodeVotes]]
    ) -> Callable[[int, torch.Tensor], None]:
        """An attention observer that hands each voting row its step's probabilities."""
        before = self.kv.lengths.clone()  # this step's token sits right after them

        def record(layer: int, probs: torch.Tensor) -> None:  # probs: [B, Hq, 1, K + 1]
            if self.kv.windows[layer] is not None:
                return
            heads = self.kv.keys[layer].shape[1]
            for r, votes in voting:
                seen = int(before[r, layer]) + 1
                votes.record(layer, probs[r, :, 0, :seen], heads)

        return record

    def _reselect(self, voting: list[tuple[int, DecodeVotes]]) -> None:
        """Re-select the layers of voting rows that outgrew their slack."""
        for r, votes in voting:
            for layer, window in enumerate(self.kv.windows):
                length = int(self.kv.lengths[r, layer])
                if window is None and votes.due(layer, length):
                    self.kv.compact(r, layer, votes.select(layer, length))

    def run(self) -> Iterator[StepOutput]:
        """Step until every row has finished, yielding each step's outputs."""
        while self.rows:
            yield from self.step()
