"""The engine: prompt -> cache tiers / prefill with a press -> decode -> cited answer.

Its configuration is :class:`~ragsnap.engine.config.EngineConfig` (every default once);
:meth:`RagSnapEngine.load` builds one from keyword arguments and ``RAGSNAP_*``, as the CLI
and the server do, so an in-process engine caches, drafts and threads like they do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ragsnap.cache.backends.store import KVStore
from ragsnap.cache.report import CacheReport
from ragsnap.cache.serialization import parse_dtype
from ragsnap.cache.tiers.cached_prefill import CachedPrefill, PrefixHit
from ragsnap.citations.options import CitationOptions
from ragsnap.compression import make_press
from ragsnap.compression.lookup_focus import uses_focus
from ragsnap.compression.propagate import without_propagation
from ragsnap.engine.citing import AnswerCiting
from ragsnap.engine.config import EngineConfig, configured
from ragsnap.engine.events import AnswerEvent, CitationsEvent, DoneEvent
from ragsnap.engine.loading import configured_model, runtime_for
from ragsnap.engine.prepared import AnswerOptions, PendingAnswer, PreparedAnswer, TextStream
from ragsnap.engine.single_answer import stream_answer
from ragsnap.prompt.assembly import (
    PROMPT_TEMPLATE_VERSION,
    ChatContext,
    DocumentOrder,
    PromptLayout,
)
from ragsnap.prompt.documents import Document
from ragsnap.prompt.focus import prompt_focus
from ragsnap.prompt.order import fit_prompt
from ragsnap.prompt.structure import prompt_roles
from ragsnap.runtime.decode import DecodeRow, LogitsProcessor
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.loading.models import EMBEDDED, LoadedModel

__all__ = ["AnswerOptions", "PendingAnswer", "PreparedAnswer", "RagSnapEngine", "TextStream"]


class RagSnapEngine:
    """Owns a model runtime and answers questions over documents with a compressed prompt cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore | None = None,
        config: EngineConfig | None = None,
        *,
        prefill_chunk: int | None = None,
        **settings: Any,
    ) -> None:
        """An engine on ``loaded``: ``store`` keeps compressed prompt caches (None: off);
        ``config`` (default: the environment's) with ``settings`` (its fields) on top; a
        ``prefill_chunk`` of tokens per prefill pass (None: one; the scheduler chunks)."""
        if config is None or settings:
            base = config.model_dump() if config is not None else {}
            config = configured(EngineConfig, **{**base, **settings})
        self.config = config
        self.loaded = loaded
        self.runtime = runtime_for(loaded, config, prefill_chunk)
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.store = store
        self.tiers: CachedPrefill | None = None
        self.citing = AnswerCiting(self.runtime, self.tokenizer)
        if store is not None and store.enabled:
            dtype = None if config.storage_dtype == "auto" else parse_dtype(config.storage_dtype)
            self.tiers = CachedPrefill(
                self.runtime,
                loaded,
                store,
                prefix_cache=config.prefix_cache,
                prefix_store=config.prefix_store,
                storage_dtype=dtype,
                document_cache=config.document_cache,
                recompute_share=config.recompute_share,
                recompute_select=config.recompute_select,
                prefix_memory_bytes=config.prefix_memory_mb << 20,
                hit_memory_bytes=config.hit_memory_mb << 20,
            )

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        store: KVStore | None = None,
        prefill_chunk: int | None = None,
        **load_options: Any,
    ) -> RagSnapEngine:
        """Open the config's KV store (unless ``store`` is given), set its threads, load
        its model (``load_options``: see :func:`load_model`), build an engine on them."""
        if store is None:
            from ragsnap.cache import open_store

            store = open_store(config.cache_url, key=config.cache_secret)
        loaded = configured_model(config, **load_options)
        return cls(loaded, store, config, prefill_chunk=prefill_chunk)

    @classmethod
    def load(
        cls, model: str | None = EMBEDDED, *, store: KVStore | None = None, **settings: Any
    ) -> RagSnapEngine:
        """Load ``model`` as ``ragsnap ask`` and ``ragsnap serve`` do: ``settings`` are
        :class:`EngineConfig` fields (``device``, ``dtype``, ``cache_url``, ``threads``...;
        None: not given) over ``RAGSNAP_*`` and the defaults, so the engine has a KV cache
        (unless ``store`` or ``cache_url`` say otherwise), drafts tokens and sets threads;
        others (``attn_implementation``, ``revision``, ``prefill_chunk``) go to
        :meth:`from_config`."""
        given = {name: value for name, value in settings.items() if value is not None}
        fields = {k: given.pop(k) for k in list(given) if k in EngineConfig.model_fields}
        config = configured(EngineConfig, model=model or EMBEDDED, **fields)
        return cls.from_config(config, store=store, **given)

    def default_options(self, **given: Any) -> AnswerOptions:
        """The options of a request that says nothing more than ``given`` (fields of
        :class:`AnswerOptions`): the config's press, answer length, document order,
        prefill path and abstention."""
        config = self.config
        press = given.get("press") or make_press(config.default_press)
        given["press"] = without_propagation(press) if config.full_prefill else press
        given.setdefault(
            "generation", GenerationConfig(max_new_tokens=config.default_max_new_tokens)
        )
        given.setdefault("document_order", config.document_order)
        given.setdefault(
            "citations",
            CitationOptions(unsupported=config.unsupported, abstain_text=config.abstain_text),
        )
        return AnswerOptions(**given)

    def reserve_prefix_hits(self, rows: int, tokens: int) -> int:
        """Bytes reserved now for ``rows`` prefix hits of up to ``tokens`` tokens each (fresh
        memory is slow to touch on first use); 0 without a prefix tier."""
        if not tokens or self.tiers is None or not self.tiers.prefix_cache:
            return 0
        return self.runtime.reserve_tails(rows, tokens)

    def build_prompt(
        self,
        question: str,
        documents: Sequence[Document],
        generation: GenerationConfig,
        *,
        answer_prefix: str = "",
        chat: ChatContext | None = None,
        order: DocumentOrder | None = None,
    ) -> PromptLayout:
        return fit_prompt(
            self.tokenizer,
            self.loaded.context_length,
            question,
            documents,
            generation.max_new_tokens,
            order or self.config.document_order,
            answer_prefix=answer_prefix,
            chat=chat,
        )

    # -- the three stages of an answer (the scheduler interleaves them) -----------------

    def prompt_of(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        namespace: str = "default",
    ) -> PromptLayout:
        """The prompt ``options`` ask for (chat context, document order). Under the
        ``stable`` order a document set the cache tiers recorded is laid out as recorded;
        one they did not is laid out by relevance, and that layout is recorded."""
        order = options.document_order
        recorded = None
        if order == "stable" and self.tiers is not None:
            recorded = self.tiers.orders.ordered(documents, PROMPT_TEMPLATE_VERSION, namespace)
        layout = self.build_prompt(
            question,
            documents if recorded is None else recorded,
            options.generation,
            chat=options.chat,
            order=order if recorded is None else "given",
        )
        if order == "stable" and recorded is None and self.tiers is not None:
            self.tiers.orders.record(
                documents, layout.documents, PROMPT_TEMPLATE_VERSION, namespace
            )
        return layout

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
        layout = self.prompt_of(question, documents, options, namespace)
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
        """Assemble the prompt (unless ``layout`` is it), prefill it through the cache tiers;
        ``on_chunk`` runs between prefill chunks (an exception from it abandons the prefill).
        The entries it computed are written after the answer (:meth:`store_pending`)."""
        started = time.perf_counter()
        if layout is None:
            layout = self.prompt_of(question, documents, options, namespace)
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
        return self.citing.logits_processor(prepared)

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
        if store_pending:
            self.store_pending(prepared)  # after the last token
        return self.citing.final_events(prepared, row, ttft_s, self.loaded.model_id)

    # -- one answer on its own (ragsnap.engine.single_answer) -----------------------------

    def stream(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions | None = None,
        should_stop: Callable[[], bool] | None = None,
        namespace: str = "default",
    ) -> Iterator[AnswerEvent]:
        """Answer ``question`` over ``documents``: meta, token..., citations, done (see
        :func:`~ragsnap.engine.single_answer.stream_answer`)."""
        options = options or self.default_options()
        return stream_answer(self, question, documents, options, should_stop, namespace)

    def answer(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions | None = None,
    ) -> DoneEvent:
        """Answer without streaming: the final :class:`DoneEvent`."""
        done = [e for e in self.stream(question, documents, options) if isinstance(e, DoneEvent)]
        return done[-1]
