"""The engine: prompt -> cache tiers / prefill with a press -> decode -> cited answer.

Its configuration is :class:`~ragsnap.engine.config.EngineConfig` (every default once);
:meth:`RagSnapEngine.load` builds one from keyword arguments and ``RAGSNAP_*``, as the CLI
and the server do, so an in-process engine caches, drafts and threads like they do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from ragsnap.cache.backends.store import KVStore
from ragsnap.cache.report import CacheReport
from ragsnap.cache.tiers.plans import ExactHit, PrefixHit
from ragsnap.compression import Press
from ragsnap.engine.citing import AnswerCiting
from ragsnap.engine.config import EngineConfig, configured
from ragsnap.engine.events import AnswerEvent, CitationsEvent, DoneEvent
from ragsnap.engine.execute import PlanExecutor
from ragsnap.engine.loading import configured_model, runtime_for, tiers_for
from ragsnap.engine.prepared import (
    AnswerOptions,
    PendingAnswer,
    PlannedAnswer,
    PreparedAnswer,
    TextStream,
)
from ragsnap.engine.request_options import answer_options
from ragsnap.engine.single_answer import stream_answer
from ragsnap.prompt.assembly import (
    PROMPT_TEMPLATE_VERSION,
    ChatContext,
    DocumentOrder,
    PromptLayout,
)
from ragsnap.prompt.documents import Document
from ragsnap.prompt.order import fit_prompt
from ragsnap.runtime.decode import DecodeBatch, DecodeRow, LogitsProcessor
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.loading.models import EMBEDDED, LoadedModel
from ragsnap.runtime.prefill import PrefillResult, Step, drain

__all__ = [
    "AnswerOptions",
    "PendingAnswer",
    "PlannedAnswer",
    "PreparedAnswer",
    "RagSnapEngine",
    "TextStream",
]


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
        self.tiers = tiers_for(self.runtime, store, config)
        self.citing = AnswerCiting(self.runtime, self.tokenizer)
        self.executor = PlanExecutor(
            self.runtime, self.tiers, config.recompute_share, config.recompute_select
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
        """The options of a request that says nothing more than ``given`` (keywords of
        :func:`~ragsnap.engine.request_options.answer_options`: ``compression``, ``press``,
        ``generation``, ``citations``...), the rest from the config."""
        return answer_options(self.config, **given)

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

    def prefill(
        self, layout: PromptLayout, press: Press, question: str, namespace: str = "default"
    ) -> tuple[PrefillResult, CacheReport]:
        """``layout``'s compressed cache through the tiers in this thread, and what they did
        (see :meth:`PlanExecutor.prefill`)."""
        return self.executor.prefill(layout, press, question, namespace)

    def lookup(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        namespace: str = "default",
    ) -> PreparedAnswer | PendingAnswer | PlannedAnswer:
        """What the store holds for this request, without computing: an exact hit ready to
        decode, a prefix hit to finish (:meth:`finish_prefix_hits`), or a plan to execute
        (:meth:`execute`)."""
        started = time.perf_counter()
        layout = self.prompt_of(question, documents, options, namespace)
        prompt = self.executor.plan(layout, options.press, question, namespace)
        if isinstance(prompt.plan, ExactHit):
            result = self.executor.from_stored(prompt.plan)
            return PreparedAnswer(layout, result, prompt.plan.report, options, started, question)
        kind = PendingAnswer if isinstance(prompt.plan, PrefixHit) else PlannedAnswer
        return kind(prompt, options, started, question)

    def execute(
        self, planned: PlannedAnswer, chunk: int | None = None
    ) -> Generator[Step, None, PreparedAnswer]:
        """Execute ``planned``'s plan: a ``ChunkStep`` before each prefill chunk of ``chunk``
        tokens (and ``PromptLogits`` once the last logits exist), then the answer ready to
        decode (its entries are written after the answer, :meth:`store_pending`)."""
        result = yield from self.executor.execute(planned.prompt, chunk)
        return planned.prepared(result)

    def finish_prefix_hits(
        self, pending: Sequence[PendingAnswer]
    ) -> Generator[Step, None, list[PreparedAnswer]]:
        """Finish the tails of ``pending`` together (their last logits, then each draft pass,
        yielded on the way); each is then ready to decode (entries: :meth:`store_pending`)."""
        results = yield from self.executor.finish_prefix_hits([p.prompt for p in pending])
        return [p.prepared(result) for p, result in zip(pending, results, strict=True)]

    def prepare(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        namespace: str = "default",
        on_chunk: Callable[[], None] | None = None,
        layout: PromptLayout | None = None,
    ) -> PreparedAnswer:
        """Assemble the prompt (unless ``layout`` is it), look it up and execute its plan
        in this thread; ``on_chunk`` runs between prefill chunks (an exception from it
        abandons the prefill). The entries it computed are written after the answer
        (:meth:`store_pending`)."""
        started = time.perf_counter()
        if layout is None:
            layout = self.prompt_of(question, documents, options, namespace)
        prompt = self.executor.plan(layout, options.press, question, namespace)
        prepared: PreparedAnswer = drain(
            self.execute(PlannedAnswer(prompt, options, started, question)), on_chunk
        )
        return prepared

    def decode_batch(self) -> DecodeBatch:
        return self.runtime.decode_batch()

    def kv_bytes_per_token(self) -> int:
        return self.runtime.kv_bytes_per_token()

    def logits_processor(self, prepared: PreparedAnswer | PlannedAnswer) -> LogitsProcessor | None:
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
