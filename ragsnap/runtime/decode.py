"""The decode loop: rows with their own sampler, stop tokens, length and cancellation.

A :class:`DecodeBatch` holds any number of rows (requests) and advances all of them with
one model call per :meth:`DecodeBatch.step` (one per lane where attention is recorded or
the model has no lean pass). Rows join and leave between steps; a
row's tokens depend only on its own cache and sampler, never on the other rows (up to
float noise in the batched matmuls). One request decoding alone is a batch of one row.

A lane is rows of like cache widths sharing one set of buffers (:class:`Lane`). A row
joins the first lane where the widest and narrowest caches stay within a factor
``1 / LANE_SHARE`` of each other, else opens one: buffers are padded to their lane's widest
row, so a full cache beside compressed ones (or a long prompt beside short ones) costs its
own lane one more model call per step instead of padding every row to its length.

With ``speculate=k``, a greedy row also feeds up to ``k`` drafted tokens
(:mod:`ragsnap.runtime.drafts`: the ones a lookahead press drafted on the full cache, and
with ``ngrams`` prompt n-grams) after its next token, and keeps those its own logits
confirm: one step may then give a row several tokens, the same ones plain greedy decoding
gives (up to float noise). A pass over more tokens costs more, and every row of the pass
is padded to the longest, so a pass feeds at most ``DRAFT_PASS_TOKENS`` tokens in all (8 on
4-bit weights, whose products take at most 8 rows).

With ``commit_drafts``, a greedy row whose prefill drafted tokens on the full cache (the
lookahead press) takes them as its answer's first tokens instead of checking them: its
first pass feeds them all on the compressed cache, whatever the pass budget (one a step
while a row of the batch records its attention), and keeps them. The answer then starts
exactly as greedy decoding on the full cache does and goes on from the compressed cache;
rows with a logits processor or decode compression never commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.compression.decode_snapkv import DecodeSnapKV, DecodeVotes
from ragsnap.runtime.attention import observe_attention
from ragsnap.runtime.drafts import Drafts
from ragsnap.runtime.forward import BatchedKV, DraftPass, forward_lanes, forward_rows
from ragsnap.runtime.generation import GenerationConfig, TokenSampler
from ragsnap.runtime.llama_pass import ChunkFeed, LlamaPass, computes_chunks
from ragsnap.runtime.prefill import PrefillResult

# spare cache entries a new row reserves per layer; a longer answer grows its buffers
RESERVE_TOKENS = 256

# the most tokens (rows x longest row, padding included) a pass with drafts feeds. On a
# 2-core AVX2 CPU (embedded model, float32, 1 thread) a pass took 52 ms for 1 row of 1
# token, 118 ms for 1 row of 5; 114 / 139 ms for 4 rows of 1 / 3; 139 / 250 ms for 8 rows
# of 1 / 5: drafts paid at 1 and 4 rows, not at 8 (bench speculate, lab/results.md). On
# 4-bit weights a pass past 8 tokens leaves them for the dense ones: there a budget of 8
# decoded 1 compressed row in 6.4-6.6 ms a token against 7.6-9.1 at 12, and 4 rows in
# 6.5-6.7 against 7.5 (2 threads, AMX Xeon, the same answers); on dense weights 8 and 12
# were alike (1 row 12.8-15.4 against 12.9-13.1 ms, 4 rows 7.6-7.7 against 7.8-8.0)
DRAFT_PASS_TOKENS = 12

# rows share a lane while its narrowest cache holds at least this share of its widest's
# entries: a lane's padding at most doubles the memory of its rows' caches
LANE_SHARE = 0.5

# (the row's tokens so far, its next-token logits [1, V]) -> logits to sample from
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class DecodeRow:
    """One request in a :class:`DecodeBatch`.

    ``next_logits`` (``[1, V]``) predict the row's next token; ``decode_s`` adds up the
    model steps this row took part in (its per-token latency, shared with its batch).
    ``logits_processor`` (optional) rewrites the row's logits before its sampler picks.
    ``votes`` (with decode-phase SnapKV) records its attention and bounds its cache.
    ``drafts`` (greedy rows of a speculating batch) drafts its next tokens; ``proposed``
    and ``accepted`` count the drafted tokens fed and kept.
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
    drafts: Drafts | None = None
    proposed: int = 0
    accepted: int = 0
    # the full-cache draft this row takes as its first tokens (commit_drafts)
    commit: list[int] = field(default_factory=list)

    @property
    def committing(self) -> bool:
        """Whether committed tokens are still to come."""
        return len(self.tokens) < len(self.commit)


@dataclass
class StepOutput:
    """One new token of a row (None when it stopped on an end-of-turn token or was
    cancelled) and, on the row's last output, why it ended. A step gives a row one output,
    or several in order when it kept drafted tokens."""

    key: Hashable
    token: int | None
    finish_reason: str | None


@dataclass
class Lane:
    """Rows of like cache widths (``rows[r]`` is row ``r`` of ``kv``), decoded with one
    model call per step."""

    kv: BatchedKV
    rows: list[DecodeRow] = field(default_factory=list)

    def fits(self, entries: int, share: float | None = None) -> bool:
        """Whether a row whose longest layer holds ``entries`` may join: the lane's widest
        and narrowest rows then stay within ``1 / share`` of each other (a row counts at
        least :data:`RESERVE_TOKENS`, the spare room every row's buffer has anyway)."""
        widths = [*self.kv.lengths.max(dim=1).values.tolist(), entries]
        widths = [max(int(w), RESERVE_TOKENS) for w in widths]
        return min(widths) >= (LANE_SHARE if share is None else share) * max(widths)


class DecodeBatch:
    """Rows decoding together on one model (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        cache_kwarg: str,
        windows: list[int | None],
        stop_ids: set[int],
        speculate: int = 0,
        ngrams: bool = False,
        commit_drafts: bool = False,
        lean: LlamaPass | None = None,
        pass_tokens: int = DRAFT_PASS_TOKENS,
    ):
        """``pass_tokens``: the most tokens a pass with drafts feeds (see
        :data:`DRAFT_PASS_TOKENS`; a model decoding on 4-bit weights passes the most rows
        its 4-bit products take, :data:`~ragsnap.runtime.loading.four_bit_linears.MAX_ROWS`)."""
        self.model = model
        self.pass_tokens = pass_tokens
        self.lean = lean
        self.cache_kwarg = cache_kwarg
        self.stop_ids = stop_ids
        self.speculate = speculate
        self.ngrams = ngrams
        self.commit_drafts = commit_drafts
        self.windows = windows
        self.lanes: list[Lane] = []
        self._cancelled: set[Hashable] = set()
        self.last_step_s = 0.0

    def __len__(self) -> int:
        return sum(len(lane.rows) for lane in self.lanes)

    @property
    def rows(self) -> list[DecodeRow]:
        """Every row, lane by lane."""
        return [row for lane in self.lanes for row in lane.rows]

    def kv_bytes(self) -> int:
        """Bytes of the entries the rows hold (padding and spare room excluded)."""
        return sum(lane.kv.nbytes() for lane in self.lanes)

    def buffer_bytes(self) -> int:
        """Bytes of every lane's key and value buffers (padding and spare room included)."""
        return sum(k.numel() * k.element_size() * 2 for lane in self.lanes for k in lane.kv.keys)

    def add(
        self,
        key: Hashable,
        prefill: PrefillResult,
        generation: GenerationConfig,
        should_stop: Callable[[list[int]], bool] | None = None,
        logits_processor: LogitsProcessor | None = None,
        decode_compression: DecodeSnapKV | None = None,
        context: Sequence[int] = (),
    ) -> DecodeRow:
        """A new row decoding from ``prefill``; it takes part from the next step on.

        ``logits_processor(tokens, logits)`` runs on the row's logits before each pick
        (e.g. a constraint that masks tokens with ``-inf``); it sees only its own row.
        ``decode_compression`` keeps the row's cache near its starting length per layer.
        ``context`` (the prompt's token ids) is where a speculating batch looks up n-gram
        drafts for a greedy row without decode compression; the tokens a lookahead press
        drafted on the full cache (``prefill.draft``) are its first guess.

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
        elif self.speculate and generation.greedy and (prefill.draft or self.ngrams):
            row.drafts = Drafts(context, self.stop_ids, prefill.draft, ngrams=self.ngrams)
        if (
            self.commit_drafts
            and generation.greedy
            and logits_processor is None
            and decode_compression is None
        ):
            row.commit = list(prefill.draft)
        layers = prefill.layers
        entries = max(k.shape[-2] for k, _ in layers)
        lane = next((lane for lane in self.lanes if lane.fits(entries)), None)
        if lane is None:
            lane = Lane(BatchedKV(self.windows))
            self.lanes.append(lane)
        lane.kv.add(
            layers,
            prefill.original_length,
            prefill.bias,
            reserve=min(generation.max_new_tokens, RESERVE_TOKENS),
        )
        lane.rows.append(row)
        return row

    def cancel(self, key: Hashable) -> None:
        """Row ``key`` leaves at the next step (its last output has reason ``cancelled``)."""
        self._cancelled.add(key)

    def rides(self) -> bool:
        """Whether a prompt chunk can be computed in this batch's next step
        (:meth:`step`): a lean pass on the CPU, with no row recording its attention and
        no attention layer rounding document products to bfloat16 (``medium``)."""
        if self.lean is None or not self.lanes or any(r.votes is not None for r in self.rows):
            return False
        return computes_chunks(self.model)

    def step(
        self, chunk: ChunkFeed | None = None, draft: DraftPass | None = None
    ) -> list[StepOutput]:
        """Pick every row's next token, retire finished rows, run one model call for the rest
        (with each speculating row's draft after its token), then keep what it confirms.
        ``chunk``: a prompt chunk computed in the same call when :meth:`rides` (then
        ``chunk.done``; else the caller computes it). ``draft``: a prefix-hit group's draft
        pass computed in the same call when :meth:`rides` (then ``draft.logits`` is set)."""
        outputs: list[StepOutput] = []
        for row in self.rows:
            token: int | None = None
            if row.key in self._cancelled:
                row.finish_reason = "cancelled"
            else:
                token = (
                    row.commit[len(row.tokens)]
                    if row.committing
                    else self._choose(row, row.next_logits)
                )
                if token in self.stop_ids:
                    token, row.finish_reason = None, "stop"
                else:
                    self._append(row, token)
            outputs.append(StepOutput(row.key, token, row.finish_reason))
        self._cancelled.difference_update(o.key for o in outputs if o.finish_reason)
        self._retire()
        if not self.lanes:
            return outputs
        started = time.perf_counter()
        rows = len(self)
        plans = [(lane, self._drafts(lane.rows, rows)) for lane in self.lanes]
        voting = any(row.votes is not None for row in self.rows)
        riding = chunk if chunk is not None and self.rides() else None
        drafting = draft if draft is not None and self.rides() else None
        if self.lean is not None and (len(plans) > 1 or riding or drafting) and not voting:
            # one pass for every lane (the chunk, the draft): the linears read their weights once
            last = not any(d for _, drafts in plans for d in drafts)
            batches = [lane.kv for lane, _ in plans]
            feeds = [self._fed(lane, drafts) for lane, drafts in plans]
            lasts = [last] * len(plans)
            queries: list[dict[int, list[torch.Tensor]] | None] = [None] * len(plans)
            if drafting is not None:
                batches.append(drafting.batch)
                feeds.append(drafting.tokens)
                lasts.append(False)
                queries.append(drafting.queries)
            everything = forward_lanes(
                self.lean, batches, feeds, last=lasts, chunk=riding, queries=queries
            )
            if drafting is not None:
                drafting.logits = everything.pop()
            for (lane, drafts), logits in zip(plans, everything, strict=True):
                self._take(lane, drafts, logits, outputs)
        else:
            for lane, drafts in plans:
                self._take(lane, drafts, self._forward(lane, drafts), outputs)
        self.last_step_s = time.perf_counter() - started
        for row in self.rows:  # a step's latency is every row's: they wait for each lane
            row.decode_s += self.last_step_s
            row.steps += 1
        self._retire()
        return outputs

    @staticmethod
    def _fed(lane: Lane, drafts: list[list[int]]) -> list[list[int]]:
        """What each row of ``lane`` is fed this step: its last token, then its draft."""
        return [[row.tokens[-1], *draft] for row, draft in zip(lane.rows, drafts, strict=True)]

    def _forward(self, lane: Lane, drafts: list[list[int]]) -> torch.Tensor:
        """One model call for ``lane``'s rows, recording the attention of its voting rows."""
        voting = [(r, row.votes) for r, row in enumerate(lane.rows) if row.votes is not None]
        with observe_attention(self._recorder(lane.kv, voting)) if voting else nullcontext():
            logits = forward_rows(
                self.model,
                self.cache_kwarg,
                lane.kv,
                self._fed(lane, drafts),
                last=not any(drafts),
                lean=None if voting else self.lean,
            )
        self._reselect(lane.kv, voting)
        return logits

    def _take(
        self,
        lane: Lane,
        drafts: list[list[int]],
        logits: torch.Tensor,
        outputs: list[StepOutput],
    ) -> None:
        """Keep what ``logits`` (``[B, V]``, or ``[B, q, V]`` after drafts) confirm of each
        row's committed or drafted tokens; the rest leaves the cache."""
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        for r, (row, draft) in enumerate(zip(lane.rows, drafts, strict=True)):
            if logits.dim() == 2:
                row.next_logits = logits[r : r + 1]
                continue
            if row.committing:  # its draft is the rest of its commit: fed, not checked
                kept = self._keep(row, draft, outputs)
            else:
                kept = self._verify(row, draft, logits[r], outputs)
            row.next_logits = logits[r, kept : kept + 1]
            lane.kv.retract(r, len(draft) - kept)

    def _choose(self, row: DecodeRow, logits: torch.Tensor) -> int:
        """The token ``row``'s sampler picks from ``logits`` ``[1, V]`` after its processor."""
        if row.logits_processor is not None:
            logits = row.logits_processor(row.tokens, logits)
        return row.sampler(logits)

    def _append(self, row: DecodeRow, token: int) -> None:
        """Give ``row`` the (non-stop) ``token``; ends the row at its length or stop rule."""
        row.tokens.append(token)
        if row.drafts is not None:
            row.drafts.extend((token,))
        if len(row.tokens) >= row.generation.max_new_tokens:
            row.finish_reason = "length"
        elif row.should_stop is not None and row.should_stop(row.tokens):
            row.finish_reason = "stop"

    def _retire(self) -> None:
        """Drop the rows that ended (their caches leave the batch), and empty lanes."""
        for lane in self.lanes:
            going = [i for i, row in enumerate(lane.rows) if row.finish_reason is None]
            if len(going) < len(lane.rows):
                lane.kv.keep(going)
                lane.rows = [lane.rows[i] for i in going]
        self.lanes = [lane for lane in self.lanes if lane.rows]

    def _drafts(self, rows: list[DecodeRow], passing: int) -> list[list[int]]:
        """Per row of ``rows``, the tokens it feeds after its next one in a step of
        ``passing`` rows (none for a row that does not speculate, and for every row while
        some row's attention is recorded: one query per row then)."""
        most = min(self.speculate, self.pass_tokens // passing - 1)
        if any(row.votes is not None for row in rows):
            return [[] for _ in rows]
        out = []
        for row in rows:
            done = len(row.tokens)
            room = row.generation.max_new_tokens - done
            if row.committing:
                out.append(row.commit[done : done + room])
                continue
            draft = row.drafts.draft(min(most, room)) if row.drafts and most >= 1 else []
            row.proposed += len(draft)
            out.append(draft)
        return out

    def _keep(self, row: DecodeRow, draft: list[int], outputs: list[StepOutput]) -> int:
        """Give ``row`` its committed ``draft`` until a stop rule or its length ends it;
        returns how many tokens it kept."""
        for j, token in enumerate(draft):
            self._append(row, token)
            outputs.append(StepOutput(row.key, token, row.finish_reason))
            if row.finish_reason is not None:
                return j + 1
        return len(draft)

    def _verify(
        self, row: DecodeRow, draft: list[int], logits: torch.Tensor, outputs: list[StepOutput]
    ) -> int:
        """Keep the longest prefix of ``draft`` that ``row`` picks itself from ``logits``
        (``[q, V]``: position ``j`` predicts the token after ``draft[:j]``); returns its length."""
        for j, token in enumerate(draft):
            if self._choose(row, logits[j : j + 1]) != token:
                return j
            self._append(row, token)
            row.accepted += 1
            outputs.append(StepOutput(row.key, token, row.finish_reason))
            if row.finish_reason is not None:
                return j + 1
        return len(draft)

    @staticmethod
    def _recorder(
        kv: BatchedKV, voting: list[tuple[int, DecodeVotes]]
    ) -> Callable[[int, torch.Tensor], None]:
        """An attention observer that hands each voting row of ``kv`` its step's
        probabilities."""
        before = kv.lengths.clone()  # this step's token sits right after them

        def record(layer: int, probs: torch.Tensor) -> None:  # probs: [B, Hq, 1, K + 1]
            if kv.windows[layer] is not None:
                return
            heads = kv.keys[layer].shape[1]
            for r, votes in voting:
                seen = int(before[r, layer]) + 1
                votes.record(layer, probs[r, :, 0, :seen], heads)

        return record

    @staticmethod
    def _reselect(kv: BatchedKV, voting: list[tuple[int, DecodeVotes]]) -> None:
        """Re-select the layers of ``kv``'s voting rows that outgrew their slack."""
        for r, votes in voting:
            for layer, window in enumerate(kv.windows):
                length = int(kv.lengths[r, layer])
                if window is None and votes.due(layer, length):
                    kv.compact(r, layer, votes.select(layer, length))

    def run(self) -> Iterator[StepOutput]:
        """Step until every row has finished, yielding each step's outputs."""
        while self.lanes:
            yield from self.step()
