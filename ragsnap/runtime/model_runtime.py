"""The model runtime: the one object that calls the model (prefill, decode, teacher forcing)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ragsnap.compression import Press
from ragsnap.compression.propagate import propagation_of
from ragsnap.compression.words import word_starts
from ragsnap.runtime import blend as _blend
from ragsnap.runtime import prefill as _prefill
from ragsnap.runtime import tails as _tails
from ragsnap.runtime.answer_attention import answer_attention
from ragsnap.runtime.attention import install_runtime_attention
from ragsnap.runtime.decode import DRAFT_PASS_TOKENS, DecodeBatch
from ragsnap.runtime.forward import DraftPass
from ragsnap.runtime.generation import GenerationConfig, stop_token_ids
from ragsnap.runtime.kv import cache_from_layers, crop_layers, sliding_windows
from ragsnap.runtime.likelihood import mean_lift, span_lifts
from ragsnap.runtime.llama_pass import llama_pass_for
from ragsnap.runtime.loading.four_bit_linears import MAX_ROWS as FOUR_BIT_ROWS
from ragsnap.runtime.loading.models import LoadedModel
from ragsnap.runtime.prefill import ChunkStep, PrefillResult, PromptLogits, Step
from ragsnap.runtime.propagation import forced_positions
from ragsnap.runtime.teacher_force import teacher_force
from ragsnap.runtime.threads import one_torch_thread

if TYPE_CHECKING:
    from ragsnap.prompt.assembly import PromptLayout


class ModelRuntime:
    """A loaded model with ragsnap's attention function installed.

    ``chunk`` is the prefill chunk size in tokens (None: one pass per prompt); ``speculate``
    the most drafted tokens a greedy decode row feeds per step (0: none), ``ngrams``
    whether prompt n-grams draft too (see :mod:`ragsnap.runtime.drafts`); with
    ``commit_drafts`` greedy rows take a lookahead press's full-cache draft as their first
    tokens (:class:`~ragsnap.runtime.decode.DecodeBatch`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        chunk: int | None = None,
        speculate: int = 0,
        ngrams: bool = False,
        commit_drafts: bool = False,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.chunk = chunk
        self.speculate = speculate
        self.ngrams = ngrams
        self.commit_drafts = commit_drafts
        self.cache_kwarg = loaded.cache_kwarg
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.windows = sliding_windows(self.model.config)
        # batch memory of prefill_tails, reused from one batch to the next
        self._tail_scratch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._compress_pool: tuple[int, ThreadPoolExecutor] | None = None  # see row_workers
        install_runtime_attention(self.model)
        # decode steps of a plain Llama-family model skip transformers' module tree
        self.lean = llama_pass_for(self.model)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def cache_from(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return cache_from_layers(self.model.config, layers)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token adds to a full cache: keys and values of every layer and KV head
        (sliding-window layers counted in full: an upper bound)."""
        config = self.model.config
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize

    def prefill(
        self,
        input_ids: Sequence[int],
        press: Press,
        *,
        cache: Any | None = None,
        start: int = 0,
        on_chunk: Callable[[], None] | None = None,
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
        forced: torch.Tensor | None = None,
    ) -> PrefillResult:
        """:meth:`prefill_steps` drained (``on_chunk`` between chunks, see
        :func:`~ragsnap.runtime.prefill.drain`)."""
        steps = self.prefill_steps(
            input_ids, press, cache=cache, start=start, roles=roles, focus=focus, forced=forced
        )
        result: PrefillResult = _prefill.drain(steps, on_chunk)
        return result

    def prefill_steps(
        self,
        input_ids: Sequence[int],
        press: Press,
        *,
        cache: Any | None = None,
        start: int = 0,
        chunk: int | None = None,
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
        forced: torch.Tensor | None = None,
    ) -> Generator[Step, None, PrefillResult]:
        """Prefill ``input_ids[start:]`` (on ``cache`` holding the first ``start``
        positions, when given) in chunks of ``chunk`` tokens (None: :attr:`chunk`), a
        :class:`~ragsnap.runtime.prefill.ChunkStep` before each, compressing every layer
        with ``press`` at the end. ``roles`` (``[L]``,
        :func:`ragsnap.prompt.structure.prompt_roles`) feeds role-aware presses, ``focus``
        (``[L]``, :func:`ragsnap.prompt.focus.prompt_focus`) the lookup focus; ``forced``
        (``[L]`` bool) the positions a query-aware prefill always propagates."""
        results = yield from _prefill.prefill_steps(
            self.model,
            self.cache_kwarg,
            input_ids,
            press,
            cache=self.new_cache() if cache is None else cache,
            start=start,
            chunk=self.chunk if chunk is None else chunk,
            word_starts=word_starts(self.tokenizer, input_ids),
            roles=roles,
            focus=focus,
            stop_ids=self.stop_ids,
            forced=forced,
        )
        return results[0]

    def prefill_prompt(
        self,
        layout: PromptLayout,
        press: Press,
        *,
        on_chunk: Callable[[], None] | None = None,
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
    ) -> PrefillResult:
        """:meth:`prefill_prompt_steps` drained (``on_chunk`` between chunks)."""
        steps = self.prefill_prompt_steps(layout, press, roles=roles, focus=focus)
        result: PrefillResult = _prefill.drain(steps, on_chunk)
        return result

    def prefill_prompt_steps(
        self,
        layout: PromptLayout,
        press: Press,
        *,
        chunk: int | None = None,
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
    ) -> Generator[Step, None, PrefillResult]:
        """:meth:`prefill_steps` of a whole prompt as the engine runs it (see
        :meth:`_documents_first`)."""
        cache, start, documents_s = yield from self._documents_first(layout, [press], chunk)
        result = yield from self.prefill_steps(
            layout.input_ids,
            press,
            cache=cache,
            start=start,
            chunk=chunk,
            roles=roles,
            focus=focus,
            forced=forced_positions(self.tokenizer, layout),
        )
        return _with_documents(result, documents_s, layout.prefix_len if start else 0)

    def _documents_first(
        self, layout: PromptLayout | None, presses: Sequence[Press], chunk: int | None = None
    ) -> Generator[ChunkStep, None, tuple[Any, int, float]]:
        """At ``medium`` matmul precision a whole prompt is computed as a prefix hit
        computes it: the documents' full pass (:meth:`prefill_full`, bfloat16 products),
        cut back to the tail's start (:func:`~ragsnap.runtime.prefill.tail_start`, the
        earliest of ``presses``'), and then the tail exactly; so an answer does not depend on
        whether its documents' KV came from the cache. Returns the cache holding the
        documents' part, where the tail starts and the documents' seconds; a new cache and
        0 elsewhere, or when there is no tail to split off."""
        if layout is None or self.loaded.matmul_precision != "medium":
            return self.new_cache(), 0, 0.0
        if any(propagation_of(p) is not None and p.window_only for p in presses):
            return self.new_cache(), 0, 0.0  # query-aware prefill runs the whole prompt
        start = min((_prefill.tail_start(layout, p) for p in presses), default=0)
        if start <= 0:
            return self.new_cache(), 0, 0.0
        started = time.perf_counter()
        prefix = yield from self.prefill_full_steps(layout.input_ids[: layout.prefix_len], chunk)
        return self.cache_from(crop_layers(prefix, start)), start, time.perf_counter() - started

    def tails_batchable(self, tails: Sequence[_tails.Tail]) -> bool:
        """Whether :meth:`prefill_tails` can finish ``tails`` together."""
        return _tails.batchable(self.model, tails)

    def prefill_tails(self, tails: Sequence[_tails.Tail]) -> list[PrefillResult]:
        """Finish several prompts whose prefixes are loaded, in shared passes (one result
        per tail, as :meth:`prefill` with ``cache`` and ``start`` gives it)."""
        results: list[PrefillResult] = _prefill.drain(self.prefill_tails_steps(tails))
        return results

    def prefill_tails_steps(
        self, tails: Sequence[_tails.Tail]
    ) -> Generator[PromptLogits | DraftPass, None, list[PrefillResult]]:
        """:meth:`prefill_tails` as a generator: the tails' last logits
        (:class:`~ragsnap.runtime.prefill.PromptLogits`) come out before their draft, then
        each draft pass (:class:`~ragsnap.runtime.forward.DraftPass`), before the
        compression."""
        filled = [
            t
            if t.word_starts is not None
            else dataclasses.replace(t, word_starts=word_starts(self.tokenizer, t.input_ids))
            for t in tails
        ]
        threads = torch.get_num_threads()
        return (
            yield from _tails.prefill_tails_steps(
                self.model,
                self.cache_kwarg,
                filled,
                self.stop_ids,
                self._tail_scratch,
                self.row_workers(threads) if len(tails) > 1 and threads > 1 else None,
                self.lean,
            )
        )

    def row_workers(self, count: int) -> ThreadPoolExecutor:
        """``count`` threads that compress the rows of :meth:`prefill_tails` side by side,
        each on one torch thread: a row's compression is hundreds of small operations, which
        two threads speed up only 1.33x (0.28 -> 0.21 s per 2.3K-token row on 2 cores);
        8 such rows took 1.45 s side by side against 1.66 s in turn (``ragsnap bench
        batch --compare-tails``)."""
        if self._compress_pool is None or self._compress_pool[0] != count:
            if self._compress_pool is not None:
                self._compress_pool[1].shutdown(wait=False)
            pool = ThreadPoolExecutor(
                max_workers=count,
                thread_name_prefix="ragsnap-compress",
                initializer=one_torch_thread,
            )
            self._compress_pool = (count, pool)
        return self._compress_pool[1]

    def reserve_tails(self, rows: int, tokens: int) -> int:
        """Allocate and touch the batch memory :meth:`prefill_tails` reuses, for ``rows``
        prompts of up to ``tokens`` tokens (drafted tokens included); returns its bytes.

        The first use of fresh memory costs more than the copies made into it (on a 2-core
        VM, finishing 8 prefix hits of 2.3K tokens spent 3.5 s filling new pages and 0.4 s
        once they were reused), so a server pays it at start rather than on a request.
        Memory already reserved for at least as much is kept.
        """
        if rows < 1 or tokens < 1:
            return 0
        held = self._tail_scratch
        if held and all(k.shape[0] >= rows and k.shape[2] >= tokens for k, _ in held):
            return sum(k.nbytes + v.nbytes for k, v in held)  # already there
        shapes = self.prefill_full([0])  # one token gives every layer's KV heads and width
        self._tail_scratch[:] = [
            (
                k.new_zeros((rows, k.shape[1], tokens, k.shape[3])),
                v.new_zeros((rows, v.shape[1], tokens, v.shape[3])),
            )
            for k, v in shapes
        ]
        return sum(k.nbytes + v.nbytes for k, v in self._tail_scratch)

    def prefill_many(
        self,
        input_ids: Sequence[int],
        presses: Sequence[Press],
        roles: torch.Tensor | None = None,
        focus: torch.Tensor | None = None,
        layout: PromptLayout | None = None,
    ) -> list[PrefillResult]:
        """One prefill, several presses: each result has its own compressed cache. Given
        the prompt's ``layout`` (of ``input_ids``), it is computed as the engine computes it
        (:meth:`_documents_first`). A press that propagates (query-aware prefill) gets a
        prefill of its own, as a request with that press would."""
        own = [i for i, p in enumerate(presses) if propagation_of(p) is not None and p.window_only]
        if own:
            shared = [p for i, p in enumerate(presses) if i not in own]
            rest = iter(
                self.prefill_many(input_ids, shared, roles, focus, layout) if shared else []
            )
            forced = None if layout is None else forced_positions(self.tokenizer, layout)
            return [
                self.prefill(input_ids, p, roles=roles, focus=focus, forced=forced)
                if i in own
                else next(rest)
                for i, p in enumerate(presses)
            ]
        cache, start, documents_s = _prefill.drain(self._documents_first(layout, presses))
        results = _prefill.prefill(
            self.model,
            self.cache_kwarg,
            input_ids,
            presses,
            cache=cache,
            start=start,
            word_starts=word_starts(self.tokenizer, input_ids),
            roles=roles,
            focus=focus,
            stop_ids=self.stop_ids,
        )
        documents = layout.prefix_len if start and layout is not None else 0
        return [_with_documents(r, documents_s, documents) for r in results]

    def prefill_full(
        self, input_ids: Sequence[int], on_chunk: Callable[[], None] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Full KV of ``input_ids``, ``[1, Hkv, n, D]`` per layer (no press)."""
        layers: list[tuple[torch.Tensor, torch.Tensor]] = _prefill.drain(
            self.prefill_full_steps(input_ids), on_chunk
        )
        return layers

    def prefill_full_steps(
        self, input_ids: Sequence[int], chunk: int | None = None
    ) -> Generator[ChunkStep, None, list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`prefill_full` in chunks of ``chunk`` tokens (None: :attr:`chunk`), a
        :class:`~ragsnap.runtime.prefill.ChunkStep` before each."""
        cache = self.new_cache()
        yield from _prefill.prefill_full_steps(
            self.model,
            self.cache_kwarg,
            input_ids,
            cache,
            chunk=self.chunk if chunk is None else chunk,
        )
        return [(layer.keys, layer.values) for layer in cache.layers]

    def blend_support(self) -> str | None:
        """None when prompts can be assembled from per-document KV, else why not."""
        return _blend.blend_support(self.model)

    def head_kv(self, head_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The prompt head's KV (``[1, Hkv, len(head_ids), D]`` per layer), to keep and reuse."""
        return _blend.head_kv(self.model, self.cache_kwarg, head_ids)

    def blend_prefix(
        self,
        prefix_ids: Sequence[int],
        head_len: int,
        pieces: Sequence[_blend.PlacedPiece],
        share: float,
        select: str = _blend.DEFAULT_SELECTION,
        probe_ids: Sequence[int] = (),
        head: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> _blend.BlendResult:
        """The prefix KV assembled from ``pieces`` with ``share`` of their tokens recomputed,
        chosen per ``select`` (``probe_ids``: the prompt's tail, for question selection)."""
        return _blend.blend_prefix(
            self.model,
            self.cache_kwarg,
            prefix_ids,
            head_len,
            pieces,
            share,
            select,
            probe_ids,
            head,
        )

    def forward(self, token_ids: Sequence[int], cache: Any, start: int) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start..`` on a plain model cache; last logits ``[1, V]``."""
        return _prefill.forward_chunk(self.model, self.cache_kwarg, token_ids, cache, start)

    def generate(self, prefill: PrefillResult, generation: GenerationConfig) -> list[int]:
        """The answer tokens of one prefill decoded alone (a batch of one row)."""
        batch = self.decode_batch()
        row = batch.add(0, prefill, generation)
        for _ in batch.run():
            pass
        return row.tokens

    def decode_batch(self, stop_ids: set[int] | None = None) -> DecodeBatch:
        """An empty batch of decoding rows on this model (``stop_ids``: end-of-turn tokens,
        the model's own by default; an empty set decodes to the length limit)."""
        stops = self.stop_ids if stop_ids is None else stop_ids
        return DecodeBatch(
            self.model,
            self.cache_kwarg,
            self.windows,
            stops,
            self.speculate,
            self.ngrams,
            self.commit_drafts,
            self.lean,
            pass_tokens=FOUR_BIT_ROWS if self.loaded.four_bit else DRAFT_PASS_TOKENS,
        )

    def teacher_force(
        self, prefills: Sequence[PrefillResult], tokens: Sequence[int]
    ) -> torch.Tensor:
        """Log-probs ``[k, n, V]`` of each prefill's cache along ``tokens`` (one pass)."""
        return teacher_force(self.model, self.cache_kwarg, self.windows, prefills, tokens)

    def likelihood_lift(
        self,
        given: Sequence[Sequence[int]],
        alone: Sequence[Sequence[int]],
        targets: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Mean per-token log-prob ``[k]`` of each target after ``given`` minus after
        ``alone`` (two short passes, see ``runtime.likelihood``)."""
        pad = self.tokenizer.pad_token_id or 0
        return mean_lift(self.model, given, alone, targets, pad)

    def likelihood_spans(
        self,
        given: Sequence[int],
        alone: Sequence[int],
        spans: Sequence[tuple[tuple[int, int], tuple[int, int]]],
    ) -> torch.Tensor:
        """Mean per-token log-prob ``[k]`` of each span of ``given`` minus the same
        tokens' in ``alone`` (one short pass, see ``runtime.likelihood.span_lifts``)."""
        pad = self.tokenizer.pad_token_id or 0
        return span_lifts(self.model, given, alone, spans, pad)

    def answer_attention(
        self, prefill: PrefillResult, tokens: Sequence[int], layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Attention ``[n, L]`` of each answer token's query on the prompt positions the
        press kept (mean over heads and ``layers``; one pass, see ``runtime.answer_attention``)."""
        return answer_attention(self.model, self.cache_kwarg, self.windows, prefill, tokens, layers)


def _with_documents(result: PrefillResult, seconds: float, tokens: int) -> PrefillResult:
    """``result`` with the documents' pass of :meth:`ModelRuntime._documents_first` counted."""
    result.prefill_s += seconds
    result.processed_tokens += tokens
    return result
