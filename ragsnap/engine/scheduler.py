"""Continuous batching: many requests decoding together on one engine, in one thread.

The scheduler decides; the engine computes. Each step takes work up to a token budget: one
decode token for every running request, plus one chunk of a prompt's prefill
(``step_tokens`` minus the running rows, or ``IDLE_CHUNK`` when none is running). A request
is looked up in the cache tiers (:meth:`RagSnapEngine.lookup`: an exact hit joins the batch
at once) and its plan executed by the engine (:meth:`RagSnapEngine.execute`), a generator
that yields before each chunk: the scheduler advances it one chunk per step, the running
rows decoding beside it (in the chunk's own pass where it allows), so streams keep flowing
while a new prompt prefills. A greedy answer's first token is sent once its prompt's last
logits exist, before the press drafts and compresses (:meth:`_send_first`); each pass of
that draft runs in a decode step of the running rows. Prefix hits (a new question over
documents whose KV is stored) are finished in shared passes (one for their tails, one per
drafted token, in decode steps while no request waits; the running rows wait for their
compression): a prefix hit waits (the running rows decoding meanwhile) until no request
has arrived for ``gather_s`` (at most ``GATHER_MAX_S``) or the batch is full, so requests
sent together share one group. A request that finishes or is cancelled
leaves at the next step; a new one joins at the next step.

Shorter prompts first, with aging: between two chunks of a prefill, the requests that
wait are looked up; hits join or park at once, and a miss whose prompt is at most half of
what the running prefill has left starts above it: its chunks advance first, and the long
prompt's next chunk waits for its row to join. So a small request behind a long prompt waits about one chunk, however long that
prompt is. A prefill lets through at most as many tokens of other prompts as it has
itself, so it still ends within about twice its own time; a miss too long to go first
waits at the head of the queue, its lookup kept. ``max_batch=1`` is the serial behaviour: one
request at a time, start to finish.

What follows an answer's last token (attribution of its citations, its stats) runs on a
second thread, so the other rows do not wait for it. The entries an answer leaves to write
(its compressed entry; a miss's document-prefix entry, the full KV of its documents, ~100 MB
for 2K tokens in float32) are written on a third, after the answer's close (or its
cancellation), once no prompt prefills or waits (at most ``STORE_DEFER_S`` later): on two
cores, serializing and writing them during a prefill slowed that prefill by a quarter. The
in-process prefix memory and unwritten entries serve requests for them meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ragsnap.engine.config import DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS
from ragsnap.engine.engine import (
    AnswerOptions,
    PendingAnswer,
    PlannedAnswer,
    PreparedAnswer,
    RagSnapEngine,
    TextStream,
)
from ragsnap.engine.events import AnswerEvent, TokenEvent
from ragsnap.errors import KVMemoryError
from ragsnap.prompt.documents import Document
from ragsnap.runtime.decode import DecodeRow
from ragsnap.runtime.forward import DraftPass
from ragsnap.runtime.llama_pass import ChunkFeed
from ragsnap.runtime.prefill import ChunkStep, DraftChunk, PromptLogits, Step
from ragsnap.runtime.threads import background_torch_thread, one_torch_thread, torch_threads

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# the most of --kv-memory-gib the engine's in-memory tiers (document prefixes, unwritten and
# loaded entries) may hold, cut from their own bounds in proportion; the running requests
# hold the rest, so the process's KV memory stays within the bound, as vLLM's prefix
# cache lives inside its KV cache space
TIER_SHARE = 0.25


# prefill chunk while no row decodes: no stream's token gap to protect
IDLE_CHUNK = 1024
# longest wait of a document-prefix write for a moment without prefill
STORE_DEFER_S = 60.0
# a prefix hit waits for companions until no request has arrived for this long...
GATHER_S = 0.05
# ...or it has waited this long (a group's shared passes cost about as much for 8 rows as
# for one; without waiting, the first of 8 new questions sent at once started a group and
# the others queued behind it for most of a second)
GATHER_MAX_S = 0.5


class Cancelled(Exception):
    """The request being prefilled was cancelled between two chunks."""


class Request(Protocol):
    """What the scheduler needs of a request (the service's job implements it)."""

    question: str
    documents: Sequence[Document]
    options: AnswerOptions
    namespace: str

    def is_cancelled(self) -> bool: ...

    def started(self) -> None: ...

    def emit(self, event: AnswerEvent) -> None: ...

    def fail(self, error: Exception) -> None: ...

    def close(self, outcome: str) -> None: ...


@dataclass
class _Running:
    request: Request
    prepared: PreparedAnswer
    row: DecodeRow
    text: TextStream
    ttft_s: float | None = None
    kv_bytes: int = 0  # KV memory held: its compressed cache and the tokens it may add
    early: bool = False  # its first token went out before compression (not sent again)


@dataclass
class _Early:
    """A first token sent from a prompt's last logits, before its row joined."""

    text: TextStream
    ttft_s: float


@dataclass
class _Prefill:
    """A plan being executed: its request, its chunk steps (``pending``: the next one, taken
    but not run yet), its chunk size and KV bytes, the tokens it has to go and those of
    other prompts it may still let go first."""

    request: Request
    planned: PlannedAnswer
    steps: Generator[Step, None, PreparedAnswer]
    chunk: int
    kv_bytes: int
    left: int
    let_by: int
    pending: ChunkStep | None = None
    started: bool = False


@dataclass
class StepStats:
    """What the last steps looked like (for metrics): rows per decode step and its seconds."""

    batch_size: int = 0
    step_s: float = 0.0
    steps: int = 0
    on_step: Callable[[int, float], None] | None = field(default=None, repr=False)
    # (prefix hits finished together, seconds they waited for companions)
    on_group: Callable[[int, float], None] | None = field(default=None, repr=False)


class Scheduler:
    """Runs requests on ``engine`` with continuous batching (see the module docstring)."""

    def __init__(
        self,
        engine: RagSnapEngine,
        max_batch: int = DEFAULT_MAX_BATCH,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        idle_chunk: int = IDLE_CHUNK,
        prefill_threads: int | None = None,
        decode_threads: int | None = None,
        gather_s: float = GATHER_S,
        kv_memory_bytes: int | None = None,
    ) -> None:
        """``prefill_threads`` and ``decode_threads``: torch threads while a prompt prefills
        and while rows decode (None: those of the thread creating the scheduler; see
        ``runtime.threads``). ``gather_s``: the quiet time a prefix hit waits for
        companions (0: none). ``kv_memory_bytes``: the KV memory of this process, shared
        by the running requests (admission, see :meth:`kv_need`) and the engine's in-memory
        tiers, which are cut to ``TIER_SHARE`` of it at most; None: admission by
        ``max_batch`` alone, the tiers at their own bounds."""
        if max_batch < 1 or step_tokens < 1 or idle_chunk < 1:
            raise ValueError("max_batch, step_tokens and idle_chunk must be at least 1")
        if gather_s < 0:
            raise ValueError("gather_s must not be negative")
        if prefill_threads is not None and prefill_threads < 1:
            raise ValueError("prefill_threads must be at least 1")
        if kv_memory_bytes is not None and kv_memory_bytes < 1:
            raise ValueError("kv_memory_bytes must be at least 1")
        self.engine = engine
        self.prefill_threads = prefill_threads
        # torch threads of the loop's decode steps (None: those of the thread creating it)
        self.decode_threads = decode_threads or _current_torch_threads()
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.idle_chunk = idle_chunk
        self.gather_s = gather_s
        self.kv_memory_bytes = kv_memory_bytes
        # the in-memory tiers' part of it; the running requests hold at most the rest
        self.tier_memory_bytes = 0
        if kv_memory_bytes is not None and engine.tiers is not None:
            self.tier_memory_bytes = engine.tiers.fit_memory(int(kv_memory_bytes * TIER_SHARE))
        self.kv_bytes_per_token = engine.kv_bytes_per_token()
        # plans being executed, the last advancing: a long prompt's, and above it a short
        # one that goes first (see the module docstring)
        self._prefills: list[_Prefill] = []
        self.batch = engine.decode_batch()
        self.stats = StepStats()
        self._waiting: deque[Request] = deque()
        # taken from the queue to be looked up between two chunks, not decided yet: they
        # still count as waiting (a full queue refuses new requests meanwhile)
        self._considering: list[Request] = []
        self._running: dict[int, _Running] = {}
        self._next_key = 0
        self._changed = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._finisher: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self.pending_writes = 0  # answers whose entries wait for the store thread
        self._writes_lock = threading.Lock()
        # set while no prompt is looked up or prefilled and none waits for it
        self._no_prefill = threading.Event()
        self._no_prefill.set()
        self._busy: list[Request] = []  # being looked up, or finished as prefix hits
        # prefix hits waiting for companions (see the module docstring), since when
        self._parked: list[tuple[Request, PendingAnswer]] = []
        self._parked_since = 0.0
        self._last_submit = 0.0
        # misses looked up between chunks but too long to go first: id(request) -> layout
        self._deferred: dict[int, PreparedAnswer | PlannedAnswer] = {}
        # first tokens sent before their rows joined: id(request) -> its text so far
        self._early: dict[int, _Early] = {}

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        # the helper threads compute on one torch thread: each thread that computes on more
        # keeps an OpenMP team, and once the teams' threads outnumber the cores, libgomp
        # stops spinning between parallel regions; a decode step (hundreds of short
        # regions) then ran no faster on two threads than on one
        self._finisher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ragsnap-finish", initializer=one_torch_thread
        )
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ragsnap-store", initializer=background_torch_thread
        )
        self._thread = threading.Thread(target=self._run, name="ragsnap-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> list[Request]:
        """Stop after the current step; returns the requests that never started."""
        with self._changed:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            self._deferred.clear()
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._finisher is not None:  # answers already decoded still get their last events
            self._finisher.shutdown(wait=True)
            self._finisher = None
        if self._writer is not None:  # and their entries are written
            self._no_prefill.set()
            self._writer.shutdown(wait=True)
            self._writer = None
        return waiting

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, request: Request) -> None:
        with self._changed:
            self._waiting.append(request)
            self._last_submit = time.perf_counter()
            self._no_prefill.clear()
            self._changed.notify()

    def waiting(self) -> list[Request]:
        with self._changed:
            return [*self._considering, *self._waiting]

    @property
    def prefilling(self) -> list[Request]:
        """The requests being looked up, prefilled or finished as prefix hits."""
        return [p.request for p in self._prefills] + self._busy

    @property
    def running(self) -> int:
        return len(self._running) + len(self.prefilling) + len(self._parked)

    # -- the loop ----------------------------------------------------------------------

    def _next(self) -> Request | None:
        """The next waiting request to admit, or None when the batch is full, none waits,
        or parked prefix hits are due (:meth:`_gathered`)."""
        with self._changed:
            while not self._stopping:
                while self._waiting and self._waiting[0].is_cancelled():
                    cancelled = self._waiting.popleft()
                    self._deferred.pop(id(cancelled), None)
                    cancelled.close("cancelled")
                if not self._waiting and not self.prefilling and not self._parked:
                    self._no_prefill.set()
                room = len(self._running) + len(self._parked) < self.max_batch
                if self._waiting and room and self._head_fits():
                    return self._waiting.popleft()
                if self._running:
                    return None
                if self._parked:
                    due = self._gathered()
                    if due <= 0:
                        return None
                    self._changed.wait(due)
                else:
                    self._changed.wait()
            return None

    def _gathered(self) -> float:
        """Seconds until the parked prefix hits are finished (<= 0: now): the batch is
        full, no request arrived for ``gather_s``, or the first has waited ``GATHER_MAX_S``."""
        if len(self._running) + len(self._parked) >= self.max_batch:
            return 0.0
        now = time.perf_counter()
        return min(self._last_submit + self.gather_s, self._parked_since + GATHER_MAX_S) - now

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.decode_threads)  # this thread's OpenMP team, see start()
        while not self._stopping:
            if self._prefills:
                self._advance()
                continue
            request = self._next()
            if request is not None:
                self._admit(request)
            elif self._parked and self._gathered() <= 0:
                self._finish_parked()
            elif self._running:
                self._decode_step()
        for prefill in reversed(self._prefills):
            prefill.steps.close()
            prefill.request.close("cancelled")
        self._prefills = []
        for running in list(self._running.values()):
            self._end(running, "cancelled", cancelled=True)
        for request, _ in self._parked:
            request.close("cancelled")
        self._parked = []

    def _admit(self, request: Request) -> None:
        """Look ``request`` up in the store: an exact hit joins the batch at once; a prefix
        hit is parked to be finished with its companions; anything else prefills here (the
        prefix hits parked before it first), the running rows decoding between its chunks."""
        self._busy = [request]
        self._no_prefill.clear()
        try:
            found = self._admissible(request)
            if found is None:
                if id(request) in self._deferred:  # it leads the queue until memory frees
                    with self._changed:
                        self._waiting.appendleft(request)
                return
            if isinstance(found, PreparedAnswer):
                self._join(request, found)
            elif not isinstance(found, PendingAnswer):
                self._finish_parked()  # a prefill takes seconds: they do not wait for it
                self._start(request, found)
            else:
                if not self._parked:
                    self._parked_since = time.perf_counter()
                self._parked.append((request, found))
        finally:
            self._busy = []
            with self._changed:
                if not self._waiting and not self._parked and not self._prefills:
                    self._no_prefill.set()

    def _admissible(self, request: Request) -> PreparedAnswer | PlannedAnswer | None:
        """``request``'s lookup (an earlier one is kept) when it may start now; None when it
        closed, failed, or must wait for KV memory (its lookup then stays in ``_deferred``)."""
        found = self._deferred.pop(id(request), None)
        if found is None:
            request.started()
            found = self._lookup(request)
        if found is None:
            return None
        allowed = self._memory_allows(request, found)
        if allowed is False:
            self._deferred[id(request)] = found
        return found if allowed else None

    def _lookup(self, request: Request) -> PreparedAnswer | PlannedAnswer | None:
        """The engine's lookup of ``request``; None when it was cancelled or failed."""
        if request.is_cancelled():
            request.close("cancelled")
            return None
        try:
            return self.engine.lookup(
                request.question, request.documents, request.options, request.namespace
            )
        except Exception as exc:
            request.fail(exc)
            return None

    def _finish_parked(self) -> None:
        """Finish the parked prefix hits in one group (the cancelled ones close)."""
        parked, self._parked = self._parked, []
        hits = []
        for request, pending in parked:
            if request.is_cancelled():
                request.close("cancelled")
            else:
                hits.append((request, pending))
        if not hits:
            return
        if self.stats.on_group is not None:
            self.stats.on_group(len(hits), time.perf_counter() - self._parked_since)
        outer, self._busy = self._busy, [*self._busy, *(request for request, _ in hits)]
        try:
            self._finish_prefix_hits(hits)
        finally:
            self._busy = outer

    def _finish_prefix_hits(self, hits: list[tuple[Request, PendingAnswer]]) -> None:
        """Their shared passes; each first token goes out once its logits exist, and each
        pass of their draft runs in a decode step of the running rows where the batch can
        (:meth:`DecodeBatch.step`): the rows keep decoding, the weights read once for both.
        While a request waits, the passes run alone: the group ends sooner and it is
        looked up (riding, a new question's first token came 0.3-0.6 s later at c = 4)."""
        steps = self.engine.finish_prefix_hits([pending for _, pending in hits])
        try:
            with torch_threads(self.prefill_threads):
                while True:
                    try:
                        step = next(steps)
                    except StopIteration as finished:
                        prepared: list[PreparedAnswer] = finished.value
                        break
                    if isinstance(step, PromptLogits):
                        self._send_first(hits, step.logits)
                    elif isinstance(step, DraftPass) and self._running and not self._waiting:
                        self._decode_step(draft=step)  # else it runs alone: sooner done
        except Exception as exc:
            steps.close()
            for request, _ in hits:
                self._early.pop(id(request), None)
                request.fail(exc)
            return
        for (request, _), answer in zip(hits, prepared, strict=True):
            if request.is_cancelled():
                self._early.pop(id(request), None)
                request.close("cancelled")
                self._write_later(answer)
            else:
                self._join(request, answer)

    def _start(self, request: Request, planned: PlannedAnswer) -> None:
        """Begin executing ``planned``: from the next step on, its chunks advance one per
        step, each beside a decode step of the running rows, until its row joins."""
        # the per-step token budget: one token per running row, the rest for the prefill chunk;
        # with no stream waiting on it, larger chunks (still cancellable between them)
        running = len(self._running)
        chunk = (
            max(32, self.step_tokens - running)
            if running
            else max(self.idle_chunk, self.step_tokens)
        )
        tokens = planned.layout.num_tokens
        steps = self.engine.execute(planned, chunk)
        self._prefills.append(
            _Prefill(request, planned, steps, chunk, self.kv_need(request, planned), tokens, tokens)
        )

    def _advance(self) -> None:
        """One step of the prefill on top: its next chunk, beside a decode step of the
        running rows (in the chunk's pass where it allows, :class:`ChunkFeed`, else before
        it); between two chunks of the first prefill, the waiting requests that may go
        first start above it (:meth:`_shorter_first`). A prefill that ends joins the batch."""
        top = self._prefills[-1]
        request = top.request
        try:
            if request.is_cancelled():
                raise Cancelled
            if top.pending is None:
                with torch_threads(self.prefill_threads):
                    top.pending = self._next_chunk(top)  # computes the chunk before it
                if top.started and len(self._prefills) == 1:
                    top.left -= top.chunk
                    self._shorter_first(top)
                    if self._prefills[-1] is not top:
                        return  # a shorter prompt goes first; this chunk waits for it
            step, top.pending = top.pending, None
            if self._running and step.ridable:
                feed = ChunkFeed(step.ids, step.cache, step.begin)
                with torch_threads(self.prefill_threads):  # the chunk is most of the work
                    self._decode_step(feed)
                step.done = feed.done
            elif self._running and top.started:
                with torch_threads(self.decode_threads):
                    self._decode_step()
            top.started = True
            return
        except StopIteration as finished:
            prepared: PreparedAnswer = finished.value
            self._prefills.pop()
            if request.is_cancelled():
                self._early.pop(id(request), None)
                self._write_later(prepared)
                request.close("cancelled")
                return
            self._join(request, prepared)
            if self._prefills and self._running:  # its first token now, not after the
                with torch_threads(self.decode_threads):  # long prompt's next chunk
                    self._decode_step()
            return
        except Cancelled:
            request.close("cancelled")
        except Exception as exc:
            request.fail(exc)
        self._early.pop(id(request), None)
        self._prefills.remove(top)
        top.steps.close()

    def _next_chunk(self, top: _Prefill) -> ChunkStep:
        """``top``'s next chunk; on the way, its first token once the prompt's last logits
        exist (:meth:`_send_first`), and each pass of its lookahead draft, in a decode step
        of the running rows (unlike a prefix-hit group's, see :meth:`_finish_prefix_hits`,
        also while requests wait: they wait seconds for this prefill anyway, and riding
        adds a fraction of that). StopIteration when it has none left."""
        step = next(top.steps)
        while not isinstance(step, ChunkStep):  # a draft pass left to it runs itself
            if isinstance(step, PromptLogits):
                self._send_first([(top.request, top.planned)], step.logits)
            elif isinstance(step, DraftChunk) and step.ridable and self._running:
                feed = ChunkFeed(step.ids, step.cache, step.begin, queries=step.queries)
                self._decode_step(feed)
                step.logits = feed.logits
            step = next(top.steps)
        return step

    def _send_first(
        self, answers: Sequence[tuple[Request, PlannedAnswer]], logits: torch.Tensor
    ) -> None:
        """Send each answer's first token from its prompt's last logits (``logits[i]`` of
        ``answers[i]``) when its row will pick that same token (a greedy answer), so the
        draft and compression that follow are no wait for it: the meta event (its
        kept tokens not known yet), then the token. Its row skips sending it again."""
        now = time.perf_counter()
        for i, (request, planned) in enumerate(answers):
            processor = self.engine.logits_processor(planned)
            first = planned.first_events(
                logits[i : i + 1], self.batch.stop_ids, processor, self.engine.tokenizer
            )
            if first is None or request.is_cancelled():
                continue
            events, text = first
            for event in events:
                request.emit(event)
            self._early[id(request)] = _Early(text, now - planned.started)

    # -- KV memory ------------------------------------------------------------------------

    def kv_need(self, request: Request, found: PreparedAnswer | PlannedAnswer) -> int:
        """KV bytes ``request`` holds at most: an exact hit, its compressed cache; a prompt
        to prefill (or a prefix hit to finish), the full KV of every prompt token; either
        way, plus the tokens it may generate (every layer, every KV head)."""
        new = request.options.generation.max_new_tokens * self.kv_bytes_per_token
        if isinstance(found, PreparedAnswer):
            return found.prefill.kv_bytes_kept + new
        return found.layout.num_tokens * self.kv_bytes_per_token + new

    def kv_bytes_in_use(self) -> int:
        """KV bytes held by the running rows, the parked prefix hits and the prefills."""
        rows = sum(running.kv_bytes for running in list(self._running.values()))
        parked = sum(self.kv_need(request, pending) for request, pending in list(self._parked))
        return rows + parked + sum(p.kv_bytes for p in list(self._prefills))

    def prefix_hit_rows(self, tokens: int) -> int:
        """The most prefix hits of ``tokens`` tokens that may be finished together: the
        batch's ceiling, or fewer when the KV memory holds fewer (each parks its full KV)."""
        limit = self.request_memory_bytes
        if limit is None:
            return self.max_batch
        per_row = max(1, tokens * self.kv_bytes_per_token)
        return max(1, min(self.max_batch, limit // per_row))

    def tier_bytes_in_use(self) -> int:
        """Bytes the engine's in-memory tiers hold (document prefixes, entries)."""
        return 0 if self.engine.tiers is None else self.engine.tiers.memory_bytes

    @property
    def request_memory_bytes(self) -> int | None:
        """The KV memory running requests may hold: the whole less the tiers' part."""
        if self.kv_memory_bytes is None:
            return None
        return self.kv_memory_bytes - self.tier_memory_bytes

    def _head_fits(self) -> bool:
        """Whether the first waiting request fits the KV memory left (a request not looked
        up yet is let through: its lookup tells what it needs)."""
        limit = self.request_memory_bytes
        found = self._deferred.get(id(self._waiting[0]))
        if limit is None or found is None:
            return True
        return self.kv_bytes_in_use() + self.kv_need(self._waiting[0], found) <= limit

    def _memory_allows(
        self, request: Request, found: PreparedAnswer | PlannedAnswer
    ) -> bool | None:
        """True: admit; False: wait for memory; None: refused (more than the whole budget)."""
        if self.kv_memory_bytes is None:
            return True
        limit = self.kv_memory_bytes - self.tier_memory_bytes
        need = self.kv_need(request, found)
        if need > limit:
            cached = (
                f" less the {self.tier_memory_bytes / 2**30:.3f} GiB its in-memory caches hold"
                if self.tier_memory_bytes
                else ""
            )
            request.fail(
                KVMemoryError(
                    f"this request needs {need / 2**30:.3f} GiB of KV memory, more than the "
                    f"server's whole KV memory of {self.kv_memory_bytes / 2**30:.3f} GiB"
                    f"{cached} (--kv-memory-gib, RAGSNAP_KV_MEMORY_GIB): send fewer or "
                    "shorter documents, or ask for fewer max_new_tokens",
                    field="documents",
                )
            )
            return None
        return self.kv_bytes_in_use() + need <= limit

    @staticmethod
    def _goes_first(found: PlannedAnswer, first: _Prefill) -> bool:
        """Whether ``found`` may prefill before ``first``'s next chunk: at most half what
        ``first`` has to go, and no more than it may still let by."""
        tokens = found.layout.num_tokens
        return 2 * tokens <= first.left and tokens <= first.let_by

    def _shorter_first(self, first: _Prefill) -> None:
        """Between two chunks of ``first``: admit the waiting requests, in order, that are
        hits, or the first miss of at most half the tokens ``first`` has to go and of no
        more than it may still let by (it starts above ``first``; see the module docstring);
        the others keep their places."""
        if self._parked and self._gathered() <= 0:
            self._finish_parked()
        with self._changed:
            candidates, self._waiting = list(self._waiting), deque()
            self._considering = list(candidates)
        kept: list[Request] = []
        for request in candidates:
            keep = self._keeps_place(request, first)
            with self._changed:
                if keep:
                    kept.append(request)
                else:
                    self._considering.remove(request)
        with self._changed:  # ahead of those submitted meanwhile
            self._considering = []
            if self._stopping:  # stop() has handed back the queue it found
                for request in kept:
                    request.close("cancelled")
            else:
                self._waiting.extendleft(reversed(kept))

    def _keeps_place(self, request: Request, first: _Prefill) -> bool:
        """Admit ``request`` between two chunks of ``first`` if it may go now (see
        :meth:`_shorter_first`); True when it keeps its place in the queue instead."""
        if request.is_cancelled():
            self._deferred.pop(id(request), None)
            request.close("cancelled")
            return False
        room = len(self._running) + len(self._parked) + len(self.prefilling)
        if room >= self.max_batch or self._stopping:
            return True
        found = self._admissible(request)
        if found is None:
            return id(request) in self._deferred  # waits for KV memory
        if isinstance(found, PreparedAnswer):
            self._join(request, found)
        elif isinstance(found, PendingAnswer):
            if not self._parked:
                self._parked_since = time.perf_counter()
            self._parked.append((request, found))
        elif len(self._prefills) == 1 and self._goes_first(found, first):
            first.let_by -= found.layout.num_tokens
            self._start(request, found)
        else:  # too long to go first: it keeps its place, and its lookup
            self._deferred[id(request)] = found
            return True
        return False

    def _join(self, request: Request, prepared: PreparedAnswer) -> None:
        """Add ``prepared``'s row to the batch: it decodes from the next step on (its first
        token, when already sent with its meta event, is not sent again)."""
        early = self._early.pop(id(request), None)
        if early is None:
            request.emit(prepared.meta())
        key, self._next_key = self._next_key, self._next_key + 1
        # a request may end its row early (stop strings matched in the text it emitted)
        stop = getattr(request, "should_stop", None)
        row = self.batch.add(
            key,
            prepared.prefill,
            request.options.generation,
            stop,
            logits_processor=self.engine.logits_processor(prepared),
            decode_compression=request.options.decode_compression,
            context=prepared.layout.input_ids,
        )
        self._running[key] = _Running(
            request,
            prepared,
            row,
            TextStream(self.engine.tokenizer) if early is None else early.text,
            ttft_s=None if early is None else early.ttft_s,
            kv_bytes=self.kv_need(request, prepared),
            early=early is not None,
        )

    def _decode_step(self, chunk: ChunkFeed | None = None, draft: DraftPass | None = None) -> None:
        """One decode step of the running rows (``chunk``: a prefill chunk, ``draft``: a
        draft pass of prefix hits, computed in the same pass where the batch can; see
        :meth:`DecodeBatch.step`)."""
        for key, running in self._running.items():
            if running.request.is_cancelled():
                self.batch.cancel(key)
        try:
            outputs = self.batch.step(chunk, draft)
        except Exception as exc:  # the batch is unusable: every row fails, the loop goes on
            logger.exception("decode step failed")
            failed, self._running = list(self._running.values()), {}
            self.batch = self.engine.decode_batch()
            for running in failed:
                running.request.fail(exc)
            if chunk is not None or draft is not None:  # its cache may hold part of the pass:
                raise  # it fails too
            return
        rows = len({out.key for out in outputs})  # a row may give several tokens (drafts)
        self.stats.batch_size, self.stats.step_s = rows, self.batch.last_step_s
        self.stats.steps += 1
        if self.stats.on_step is not None:
            self.stats.on_step(rows, self.batch.last_step_s)
        now = time.perf_counter()
        for out in outputs:
            running = self._running[int(out.key)]  # type: ignore[call-overload]
            if out.token is not None:
                if running.ttft_s is None:
                    running.ttft_s = now - running.prepared.started
                if running.early:  # the token sent before the row joined: the same one
                    running.early = False
                elif delta := running.text.push(out.token):
                    running.request.emit(TokenEvent(text=delta))
            if out.finish_reason is not None:
                del self._running[int(out.key)]  # type: ignore[call-overload]
                self._end(running, out.finish_reason, cancelled=out.finish_reason == "cancelled")

    def _end(self, running: _Running, reason: str, *, cancelled: bool) -> None:
        request = running.request
        if cancelled:
            request.close("cancelled")
            self._write_later(running.prepared)
            return
        try:
            if rest := running.text.flush():
                request.emit(TokenEvent(text=rest))
        except Exception as exc:
            request.fail(exc)
            return
        if self._finisher is None:  # driven without start(): finish in this thread
            self._finish(running)
        else:
            self._finisher.submit(self._finish, running)

    def _finish(self, running: _Running) -> None:
        """The citations and final events of a decoded answer, then the request's close."""
        request = running.request
        prepared = running.prepared
        try:
            citations, done = self.engine.finish(
                prepared, running.row, running.ttft_s, store_pending=self._writer is None
            )
            request.emit(citations)
            request.emit(done)
        except Exception as exc:
            request.fail(exc)
        else:
            request.close("ok")
        self._write_later(prepared)

    def _write_later(self, prepared: PreparedAnswer) -> None:
        """Hand the entries ``prepared`` left to write to the store thread (written here
        when the scheduler runs without threads)."""
        if not prepared.report.pending:
            return
        if self._writer is None:
            self.engine.store_pending(prepared)
            return
        with self._writes_lock:
            self.pending_writes += 1
        self._writer.submit(self._store_pending, prepared)

    def _store_pending(self, prepared: PreparedAnswer) -> None:
        """Write ``prepared``'s pending entries once no prompt prefills or waits (or at the
        latest ``STORE_DEFER_S`` from now); store errors are logged by the tiers, never
        raised."""
        try:
            self._no_prefill.wait(STORE_DEFER_S)
            self.engine.store_pending(prepared)
        finally:
            with self._writes_lock:
                self.pending_writes -= 1


def _current_torch_threads() -> int:
    import torch

    return torch.get_num_threads()
