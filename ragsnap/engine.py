"""The engine: prompt -> cache tiers / prefill with a press -> decode -> cited answer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.cache.cached_prefill import (
    DEFAULT_HIT_MEMORY_BYTES,
    DEFAULT_PREFIX_MEMORY_BYTES,
    CachedPrefill,
    PrefixHit,
)
from ragsnap.cache.document_tier import DEFAULT_RECOMPUTE_SHARE
from ragsnap.cache.report import CacheReport
from ragsnap.cache.serialization import parse_dtype
from ragsnap.cache.store import KVStore
from ragsnap.citations import Citation, document_keep_shares, extract_citations
from ragsnap.citations.attribution import (
    answer_token_ends,
    attribute,
    default_attention_layers,
    gather_evidence,
)
from ragsnap.citations.markers import (
    MarkerConstraint,
    insert_markers,
    marker_candidates,
    vocabulary_texts,
)
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.overlap import question_relevance
from ragsnap.citations.quotes import document_sentences
from ragsnap.citations.verdict import judge
from ragsnap.compression import Press, make_press
from ragsnap.compression.decode_snapkv import DecodeSnapKV
from ragsnap.compression.lookahead import press_label
from ragsnap.compression.lookup_focus import uses_focus
from ragsnap.documents import Document
from ragsnap.events import AnswerEvent, CitationsEvent, DoneEvent, MetaEvent, TokenEvent
from ragsnap.generation import GenerationConfig
from ragsnap.kept import DocumentKeptTokens, document_kept_tokens
from ragsnap.lookup import prompt_focus
from ragsnap.models import EMBEDDED, LoadedModel, load_model
from ragsnap.prompt import ChatContext, DocumentOrder, PromptLayout, assemble_prompt
from ragsnap.runtime.blend import DEFAULT_SELECTION
from ragsnap.runtime.decode import DecodeRow, LogitsProcessor
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PrefillResult
from ragsnap.stats import AnswerStats
from ragsnap.structure import prompt_roles

logger = logging.getLogger(__name__)


@dataclass
class AnswerOptions:
    """Everything about one answer except its inputs."""

    press: Press = field(default_factory=make_press)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    chat: ChatContext | None = None  # a chat's instructions and prior turns (prompt tail)
    citations: CitationOptions = field(default_factory=CitationOptions)
    # decode-phase SnapKV: long answers stay within the prompt's budget plus a slack
    decode_compression: DecodeSnapKV | None = None
    kept_tokens: bool = False  # the done event carries each document's kept-token map
    document_order: DocumentOrder = "relevance"  # see ragsnap.prompt.DocumentOrder


@dataclass
class PendingAnswer:
    """A request whose document prefix was found in the store: its tail is left to finish
    (:meth:`RagSnapEngine.finish_prefix_hits`, several at once)."""

    layout: PromptLayout
    hit: PrefixHit
    options: AnswerOptions
    started: float
    question: str


@dataclass
class PreparedAnswer:
    """A request after prompt assembly and prefill (or a cache hit), ready to decode."""

    layout: PromptLayout
    prefill: PrefillResult
    report: CacheReport
    options: AnswerOptions
    started: float
    question: str = ""

    def meta(self) -> MetaEvent:
        return MetaEvent(
            prompt_tokens=self.layout.num_tokens,
            kept_tokens=self.prefill.kept_tokens,
            cache=self.report.status,
            documents=[
                {"index": i + 1, "id": d.id, "title": d.title}
                for i, d in enumerate(self.layout.documents)
            ],
            dropped_doc_ids=self.layout.dropped_doc_ids,
            truncated_doc_ids=self.layout.truncated_doc_ids,
        )


class TextStream:
    """Turns generated token ids into text deltas, holding back partial UTF-8 characters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if len(text) <= len(self.emitted) or text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        delta, self.emitted = text[len(self.emitted) :], text
        return delta


class RagSnapEngine:
    """Owns a model runtime and answers questions over documents with a compressed prompt cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore | None = None,
        prefix_cache: bool = True,
        storage_dtype: str | torch.dtype | None = None,
        prefill_chunk: int | None = None,
        document_cache: bool = False,
        recompute_share: float = DEFAULT_RECOMPUTE_SHARE,
        recompute_select: str = DEFAULT_SELECTION,
        prefix_memory_bytes: int = DEFAULT_PREFIX_MEMORY_BYTES,
        hit_memory_bytes: int = DEFAULT_HIT_MEMORY_BYTES,
        speculate: int = 0,
        speculate_ngrams: bool = False,
        commit_lookahead: bool = False,
    ) -> None:
        """``store`` keeps compressed prompt caches (None or a ``none`` store: caching off);
        ``prefix_cache`` also keeps the full KV of document prefixes for new questions;
        ``document_cache`` keeps each document's KV for new combinations and orders of them,
        recomputing ``recompute_share`` of their tokens with the full context, chosen per
        ``recompute_select`` (``"question"``: by the question's attention, ``"deviation"``:
        CacheBlend's layer-1 KV deviation, ``"both"``);
        ``storage_dtype`` (e.g. ``"bfloat16"``) stores KV smaller than the model computes it;
        ``prefix_memory_bytes`` of recently used document prefixes stay in memory in front
        of the store (0: off), and ``hit_memory_bytes`` of recently read or written
        compressed entries (0: off);
        ``prefill_chunk`` prefills in chunks of that many tokens (None: one pass);
        ``speculate`` lets a greedy answer feed up to that many drafted tokens per decode
        step (0: off here; ``ragsnap serve`` and ``ask`` use 8; the answers stay those of
        plain greedy decoding): those a lookahead press drafted and, with
        ``speculate_ngrams``, prompt n-grams;
        ``commit_lookahead`` makes a greedy answer (without marker control or decode
        compression) start with the tokens a lookahead press drafted on the full cache,
        fed once and kept unchecked (off here; ``ragsnap serve`` turns it on)."""
        self.loaded = loaded
        self.runtime = ModelRuntime(
            loaded,
            chunk=prefill_chunk,
            speculate=speculate,
            ngrams=speculate_ngrams,
            commit_drafts=commit_lookahead,
        )
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.stop_ids = self.runtime.stop_ids
        self.store = store
        self.tiers: CachedPrefill | None = None
        self._vocab_texts: list[str] | None = None
        self._marker_candidates: list[int] = []
        if store is not None and store.enabled:
            dtype = parse_dtype(storage_dtype) if isinstance(storage_dtype, str) else storage_dtype
            self.tiers = CachedPrefill(
                self.runtime,
                loaded,
                store,
                prefix_cache=prefix_cache,
                storage_dtype=dtype,
                document_cache=document_cache,
                recompute_share=recompute_share,
                recompute_select=recompute_select,
                prefix_memory_bytes=prefix_memory_bytes,
                hit_memory_bytes=hit_memory_bytes,
            )

    @classmethod
    def load(
        cls,
        model: str = EMBEDDED,
        *,
        store: KVStore | None = None,
        prefix_cache: bool = True,
        storage_dtype: str | torch.dtype | None = None,
        prefill_chunk: int | None = None,
        document_cache: bool = False,
        recompute_share: float = DEFAULT_RECOMPUTE_SHARE,
        prefix_memory_bytes: int = DEFAULT_PREFIX_MEMORY_BYTES,
        hit_memory_bytes: int = DEFAULT_HIT_MEMORY_BYTES,
        speculate: int = 0,
        speculate_ngrams: bool = False,
        commit_lookahead: bool = False,
        **kwargs: Any,
    ) -> RagSnapEngine:
        """Load ``model`` (see :func:`load_model` for ``kwargs``) and build an engine on it."""
        return cls(
            load_model(model, **kwargs),
            store=store,
            prefix_cache=prefix_cache,
            storage_dtype=storage_dtype,
            prefill_chunk=prefill_chunk,
            document_cache=document_cache,
            recompute_share=recompute_share,
            prefix_memory_bytes=prefix_memory_bytes,
            hit_memory_bytes=hit_memory_bytes,
            speculate=speculate,
            speculate_ngrams=speculate_ngrams,
            commit_lookahead=commit_lookahead,
        )

    def build_prompt(
        self,
        question: str,
        documents: Sequence[Document],
        generation: GenerationConfig,
        *,
        answer_prefix: str = "",
        chat: ChatContext | None = None,
        order: DocumentOrder = "relevance",
    ) -> PromptLayout:
        budget = self.loaded.context_length - generation.max_new_tokens
        if budget <= 0:  # say what to change, not a negative number of prompt tokens
            from ragsnap.errors import ConfigError

            raise ConfigError(
                f"max_new_tokens {generation.max_new_tokens} leaves no room for the prompt: "
                f"the model's context is {self.loaded.context_length} tokens",
                field="max_new_tokens",
            )
        return assemble_prompt(
            self.tokenizer,
            question,
            documents,
            max_prompt_tokens=budget,
            answer_prefix=answer_prefix,
            chat=chat,
            relevance=(
                question_relevance(question, [f"{d.title}\n{d.text}" for d in documents])
                if order == "relevance"
                else None
            ),
        )

    # -- the three stages of an answer (the scheduler interleaves them) -----------------

    def prompt_of(
        self, question: str, documents: Sequence[Document], options: AnswerOptions
    ) -> PromptLayout:
        """The prompt ``options`` ask for (chat context, document order)."""
        return self.build_prompt(
            question, documents, options.generation, chat=options.chat, order=options.document_order
        )

    def lookup(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        namespace: str = "default",
    ) -> PreparedAnswer | PendingAnswer | PromptLayout:
        """What the store holds for this request, without computing: an exact hit ready to
        decode, a prefix hit to finish, or (nothing usable) the prompt for :meth:`prepare`."""
        started = time.perf_counter()
        layout = self.prompt_of(question, documents, options)
        if self.tiers is None:
            return layout
        found, report = self.tiers.lookup(layout, options.press, question, namespace)
        if isinstance(found, PrefixHit):
            return PendingAnswer(layout, found, options, started, question)
        if found is not None:
            return PreparedAnswer(layout, found, report, options, started, question)
        return layout

    def finish_prefix_hits(self, pending: Sequence[PendingAnswer]) -> list[PreparedAnswer]:
        """Finish the tails of ``pending`` together; each is then ready to decode (its
        entry is written by :meth:`finish` or :meth:`store_pending`)."""
        assert self.tiers is not None, "prefix hits come from the cache tiers"
        results = self.tiers.finish_prefix_hits([p.hit for p in pending])
        return [
            PreparedAnswer(p.layout, result, p.hit.report, p.options, p.started, p.question)
            for p, result in zip(pending, results, strict=True)
        ]

    def prepare(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        namespace: str = "default",
        on_chunk: Callable[[], None] | None = None,
        layout: PromptLayout | None = None,
    ) -> PreparedAnswer:
        """Assemble the prompt (unless ``layout`` is it) and prefill it through the cache
        tiers (hit, prefix hit, miss).

        ``on_chunk`` runs between prefill chunks; an exception from it abandons the prefill.
        The entries it computed are written by :meth:`finish` or :meth:`store_pending`
        after the answer (served from memory until then).
        """
        started = time.perf_counter()
        if layout is None:
            layout = self.prompt_of(question, documents, options)
        if self.tiers is None:
            roles = prompt_roles(self.tokenizer, layout)
            focus = prompt_focus(self.tokenizer, layout) if uses_focus(options.press) else None
            prefill = self.runtime.prefill_prompt(
                layout, options.press, on_chunk=on_chunk, roles=roles, focus=focus
            )
            report = CacheReport(status="off")
        else:
            prefill, report = self.tiers.prefill(
                layout, options.press, question, namespace, on_chunk
            )
        return PreparedAnswer(layout, prefill, report, options, started, question)

    def logits_processor(self, prepared: PreparedAnswer) -> LogitsProcessor | None:
        """The per-row decode constraint of ``prepared`` (marker control), or None."""
        if not prepared.options.citations.marker_control:
            return None
        if self._vocab_texts is None:
            self._vocab_texts = vocabulary_texts(self.tokenizer)
            self._marker_candidates = marker_candidates(self._vocab_texts)
        count = len(prepared.layout.documents)
        return MarkerConstraint(self._vocab_texts, count, self._marker_candidates)

    def cite(
        self, prepared: PreparedAnswer, tokens: list[int], question: str
    ) -> tuple[list[Citation], str | None, float]:
        """Citations of the answer ``tokens``, the answer with inline markers (when asked
        for) and the seconds attribution took."""
        started = time.perf_counter()
        layout, prefill, options = prepared.layout, prepared.prefill, prepared.options.citations
        answer = self.tokenizer.decode(tokens, skip_special_tokens=True)
        keep_rate = prefill.keep_rate()
        shares = document_keep_shares(keep_rate, layout.doc_spans)
        if options.mode == "markers" or not layout.documents:
            return extract_citations(answer, layout.documents, shares), None, 0.0
        attention = None  # weights that give attention no say skip its pass (its cost)
        if options.weights.attention > 0:
            windows = len(self.runtime.windows)
            layers = options.attention_layers or default_attention_layers(windows)
            attention = self.runtime.answer_attention(prefill, tokens, layers)
        doc_sentences = document_sentences(self.tokenizer, layout.documents, layout.doc_spans)
        evidence = gather_evidence(
            answer,
            question,
            layout.documents,
            doc_sentences,
            attention=attention,
            token_ends=answer_token_ends(self.tokenizer, tokens),
            doc_spans=layout.doc_spans,
        )
        citations = attribute(
            answer,
            layout.documents,
            doc_sentences,
            evidence,
            options.weights,
            keep_rate=keep_rate.tolist(),
            doc_keep_shares=shares,
        )
        marked = None
        if options.inline_markers:
            per_sentence = [
                [c.index for c in citations if s in c.sentences]
                for s in range(len(evidence.sentences))
            ]
            spans = [(x.start, x.end) for x in evidence.sentences]
            marked = insert_markers(answer, spans, per_sentence)
        return citations, marked, time.perf_counter() - started

    def store_pending(self, prepared: PreparedAnswer) -> None:
        """Write the entries left for after the answer (its compressed entry, and a miss's
        document-prefix entry); a second call writes nothing."""
        if self.tiers is not None:
            self.tiers.finish(prepared.report)

    def finish(
        self,
        prepared: PreparedAnswer,
        row: DecodeRow,
        ttft_s: float | None,
        *,
        store_pending: bool = True,
    ) -> tuple[CitationsEvent, DoneEvent]:
        """Citations and the final event of a decoded answer; first writes the entries left
        for after the answer unless ``store_pending`` is False (the caller then calls
        :meth:`store_pending`)."""
        layout, prefill, report = prepared.layout, prepared.prefill, prepared.report
        if store_pending:
            self.store_pending(prepared)  # after the last token
        answer = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        citations, marked, cite_s = self.cite(prepared, row.tokens, prepared.question)
        stats = AnswerStats(
            model=self.loaded.model_id,
            device=str(self.device),
            press=press_label(prefill.press_config),
            press_config=prefill.press_config,
            budget=prefill.press_config.get("budget"),
            prompt_tokens=layout.num_tokens,
            kept_tokens=prefill.kept_tokens,
            kept_tokens_per_layer=prefill.kept_tokens_per_layer,
            prefill_tokens=prefill.processed_tokens,
            prefill_s=round(prefill.prefill_s, 4),
            compress_s=round(prefill.compress_s, 4),
            ttft_s=round(
                ttft_s if ttft_s is not None else time.perf_counter() - prepared.started, 4
            ),
            decode_ms_per_token=(
                round(1000 * row.decode_s / len(row.tokens), 3) if row.steps else None
            ),
            new_tokens=len(row.tokens),
            decode_s=round(row.decode_s, 4),
            citations_mode=prepared.options.citations.mode,
            attribution_s=round(cite_s, 4),
            kv_bytes_full=prefill.kv_bytes_full,
            kv_bytes_kept=prefill.kv_bytes_kept,
            total_s=round(time.perf_counter() - prepared.started, 4),
            cache=report.status,
            cache_bytes_read=report.bytes_read,
            cache_bytes_written=report.bytes_written,
            cache_load_s=round(report.load_s, 4),
            cache_tier=report.tier,
            reused_documents=report.reused_documents,
            recomputed_tokens=report.recomputed_tokens,
            reuse_note=report.reuse_note,
            finish_reason="length" if row.finish_reason == "length" else "stop",
            decode_reselections=row.votes.reselections if row.votes is not None else 0,
            drafted_tokens=prefill.drafted_tokens,
            prefill_path=prefill.prefill_path,
            propagate_layer=prefill.propagate_layer,
            propagated_tokens=prefill.propagated_tokens,
            full_path_reason=prefill.full_path_reason,
            drafts_proposed=row.proposed,
            drafts_kept=row.accepted,
            dropped_doc_ids=layout.dropped_doc_ids,
            truncated_doc_ids=layout.truncated_doc_ids,
        )
        kept = self.kept_map(prepared) if prepared.options.kept_tokens else None
        done = DoneEvent(
            answer=answer,
            citations=citations,
            stats=stats,
            answer_with_markers=marked,
            kept_tokens=kept,
        )
        # the verdict, and abstention when asked for (issue 43); streamed tokens stay
        done = judge(done, prepared.options.citations)
        return CitationsEvent(citations=citations, answer_with_markers=marked), done

    def kept_map(self, prepared: PreparedAnswer) -> list[DocumentKeptTokens]:
        """Per document, the share of layers and heads that kept each of its tokens."""
        layout, prefill = prepared.layout, prepared.prefill
        rate = prefill.keep_rate() if prefill.kept else torch.ones(layout.num_tokens)
        return document_kept_tokens(self.tokenizer, layout.documents, layout.doc_spans, rate)

    # -- one answer on its own ----------------------------------------------------------

    def stream(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions | None = None,
        should_stop: Callable[[], bool] | None = None,
        namespace: str = "default",
    ) -> Iterator[AnswerEvent]:
        """Answer ``question`` over ``documents``: meta, token..., citations, done.

        Closing the iterator (or ``should_stop()`` returning True) stops generation
        after the current decode step. ``namespace`` separates tenants in the KV store.
        The answer ends before the first of ``options.generation.stop`` it meets, as
        through the server (:mod:`ragsnap.stopping`).
        """
        from ragsnap.stopping import apply_stop

        options = options or AnswerOptions()
        if not options.generation.stop:
            yield from self._stream(question, documents, options, should_stop, namespace)
            return
        matched = threading.Event()

        def halt() -> bool:
            return matched.is_set() or (should_stop is not None and should_stop())

        events = self._stream(question, documents, options, halt, namespace)
        try:
            yield from apply_stop(events, options.generation.stop, matched.set)
        finally:
            events.close()

    def _stream(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        should_stop: Callable[[], bool] | None,
        namespace: str,
    ) -> Iterator[AnswerEvent]:
        prepared = self.prepare(question, documents, options, namespace)
        yield prepared.meta()
        batch = self.runtime.decode_batch()
        stop = (lambda _tokens: should_stop()) if should_stop is not None else None
        row = batch.add(
            0,
            prepared.prefill,
            options.generation,
            stop,
            self.logits_processor(prepared),
            decode_compression=options.decode_compression,
            context=prepared.layout.input_ids,
        )
        text = TextStream(self.tokenizer)
        ttft: float | None = None
        try:
            for out in batch.run():
                if out.token is not None:
                    ttft = ttft if ttft is not None else time.perf_counter() - prepared.started
                    if delta := text.push(out.token):
                        yield TokenEvent(text=delta)
            if rest := text.flush():
                yield TokenEvent(text=rest)
            yield from self.finish(prepared, row, ttft)
        finally:  # an iterator closed early still writes what the answer left to write
            self.store_pending(prepared)

    def answer(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions | None = None,
    ) -> DoneEvent:
        """Answer without streaming: the final :class:`DoneEvent`."""
        done: DoneEvent | None = None
        for event in self.stream(question, documents, options):
            if isinstance(event, DoneEvent):
                done = event
        assert done is not None
        return done
