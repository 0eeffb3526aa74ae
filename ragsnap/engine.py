"""The engine: prompt -> prefill with a press -> compressed KV cache -> streamed, cited answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.cache.cached_prefill import CachedPrefill, CacheReport
from ragsnap.cache.serialization import parse_dtype
from ragsnap.cache.store import KVStore
from ragsnap.citations import document_keep_shares, extract_citations
from ragsnap.compression import CompressedLayer, Press, compression_hooks, make_press
from ragsnap.compression.attention_bias import attention_bias, install_bias_attention
from ragsnap.compression.words import word_starts
from ragsnap.documents import Document
from ragsnap.events import AnswerEvent, CitationsEvent, DoneEvent, MetaEvent, TokenEvent
from ragsnap.generation import GenerationConfig, TokenSampler, stop_token_ids
from ragsnap.kv import cache_nbytes, derive_cache
from ragsnap.models import EMBEDDED, LoadedModel, load_model
from ragsnap.prompt import PromptLayout, assemble_prompt

logger = logging.getLogger(__name__)


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


@dataclass
class AnswerOptions:
    """Everything about one answer except its inputs."""

    press: Press = field(default_factory=make_press)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


class RagSnapEngine:
    """Owns a model and answers questions over documents with a compressed prompt cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore | None = None,
        prefix_cache: bool = True,
        storage_dtype: str | torch.dtype | None = None,
    ) -> None:
        """``store`` keeps compressed prompt caches (None or a ``none`` store: caching off);
        ``prefix_cache`` also keeps the full KV of document prefixes for new questions;
        ``storage_dtype`` (e.g. ``"bfloat16"``) stores KV smaller than the model computes it."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.store = store
        self._cached: CachedPrefill | None = None
        if store is not None and store.enabled:
            dtype = parse_dtype(storage_dtype) if isinstance(storage_dtype, str) else storage_dtype
            self._cached = CachedPrefill(
                self, store, prefix_cache=prefix_cache, storage_dtype=dtype
            )
        # attention that can add a per-key bias when a press asks for one (else unchanged)
        install_bias_attention(self.model)

    @classmethod
    def load(
        cls,
        model: str = EMBEDDED,
        *,
        store: KVStore | None = None,
        prefix_cache: bool = True,
        storage_dtype: str | torch.dtype | None = None,
        **kwargs: Any,
    ) -> RagSnapEngine:
        """Load ``model`` (see :func:`load_model` for ``kwargs``) and build an engine on it."""
        return cls(
            load_model(model, **kwargs),
            store=store,
            prefix_cache=prefix_cache,
            storage_dtype=storage_dtype,
        )

    # -- building blocks -------------------------------------------------------------

    def build_prompt(
        self,
        question: str,
        documents: Sequence[Document],
        generation: GenerationConfig,
        *,
        answer_prefix: str = "",
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
        )

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        cache: Any,
        start: int,
        bias: Mapping[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start, start+1, ...`` on top of ``cache``; last logits ``[1, V]``.

        ``bias`` maps layer index -> ``[1, Hkv, n]`` logit bias of the first ``n`` cached keys.
        """
        return self.forward_logits(token_ids, cache, start, keep=1, bias=bias)[:, -1, :]

    @torch.inference_mode()
    def forward_logits(
        self,
        token_ids: Sequence[int],
        cache: Any,
        start: int,
        keep: int = 0,
        bias: Mapping[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Like :meth:`forward`, returning the logits of the last ``keep`` positions
        (``0`` = every position): ``[1, n, V]``. Teacher forcing uses ``keep=0``."""
        input_ids = torch.tensor([list(token_ids)], device=self.device)
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device).unsqueeze(0)
        with attention_bias(bias):
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=keep,
                **{self.loaded.cache_kwarg: cache},
            )
        return out.logits

    def prefill(
        self,
        input_ids: Sequence[int],
        press: Press,
        *,
        cache: Any | None = None,
        start: int = 0,
    ) -> PrefillResult:
        """Prefill ``input_ids[start:]`` (on top of ``cache`` holding the first ``start``
        positions, when given) and compress every layer with ``press`` at the end."""
        cache = self.new_cache() if cache is None else cache
        _sync(self.device)
        started = time.perf_counter()
        starts = word_starts(self.tokenizer, input_ids)
        with compression_hooks(self.model, press, word_starts=starts) as recorder:
            recorder.armed = True
            logits = self.forward(input_ids[start:], cache, start)
        _sync(self.device)
        prefill_s = time.perf_counter() - started
        return PrefillResult(
            cache=cache,
            original_length=len(input_ids),
            next_logits=logits,
            kept=recorder.layer_results(0),
            bias=recorder.layer_bias(0),
            press_config=press.config(),
            prefill_s=prefill_s,
            compress_s=recorder.seconds,
            kv_bytes_full=recorder.bytes_seen,
            kv_bytes_kept=cache_nbytes(cache),
            processed_tokens=len(input_ids) - start,
        )

    def prefill_many(
        self, input_ids: Sequence[int], presses: Sequence[Press]
    ) -> list[PrefillResult]:
        """One prefill, several presses: each result has its own compressed cache.

        Prefill attention is full whatever the press, so the kept entries equal what a
        separate prefill per press would keep. ``prefill_s`` is the shared forward time;
        ``compress_s`` is each press's own share of the hook time.
        """
        cache = self.new_cache()
        _sync(self.device)
        started = time.perf_counter()
        starts = word_starts(self.tokenizer, input_ids)
        with compression_hooks(self.model, presses, apply=False, word_starts=starts) as recorder:
            recorder.armed = True
            logits = self.forward(input_ids, cache, 0)
        _sync(self.device)
        prefill_s = time.perf_counter() - started
        results = []
        for i, press in enumerate(presses):
            compressed = derive_cache(cache, recorder.results[i])
            results.append(
                PrefillResult(
                    cache=compressed,
                    original_length=len(input_ids),
                    next_logits=logits,
                    kept=recorder.layer_results(i),
                    bias=recorder.layer_bias(i),
                    press_config=press.config(),
                    prefill_s=prefill_s,
                    compress_s=recorder.press_seconds[i],
                    kv_bytes_full=recorder.bytes_seen,
                    kv_bytes_kept=cache_nbytes(compressed),
                    processed_tokens=len(input_ids),
                )
            )
        return results

    def decode_tokens(
        self,
        prefill: PrefillResult,
        generation: GenerationConfig,
        should_stop: Callable[[], bool] | None = None,
        timings: dict[str, float] | None = None,
    ) -> Iterator[int]:
        """Yield generated token ids until an end-of-turn token, ``max_new_tokens`` or ``should_stop()``.

        Positions continue from the original prompt length, whatever the cache kept.
        ``timings`` (when given) receives ``decode_s`` and ``decode_steps``.
        """
        sampler = TokenSampler(generation, self.device)
        logits = prefill.next_logits
        position = prefill.original_length
        decode_s, steps = 0.0, 0
        try:
            for produced in range(generation.max_new_tokens):
                token = sampler(logits)
                if token in self.stop_ids:
                    return
                yield token
                if produced + 1 == generation.max_new_tokens or (should_stop and should_stop()):
                    return
                started = time.perf_counter()
                logits = self.forward([token], prefill.cache, position, prefill.bias)
                _sync(self.device)
                decode_s += time.perf_counter() - started
                steps += 1
                position += 1
        finally:
            if timings is not None:
                timings["decode_s"], timings["decode_steps"] = decode_s, steps

    # -- the whole answer ------------------------------------------------------------

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
        """
        options = options or AnswerOptions()
        started = time.perf_counter()
        layout = self.build_prompt(question, documents, options.generation)
        prefill, report = self._cached_prefill(layout, options.press, question, namespace)
        yield MetaEvent(
            prompt_tokens=layout.num_tokens,
            kept_tokens=prefill.kept_tokens,
            cache=report.status,
            documents=[
                {"index": str(i + 1), "id": d.id, "title": d.title}
                for i, d in enumerate(layout.documents)
            ],
            dropped_doc_ids=layout.dropped_doc_ids,
            truncated_doc_ids=layout.truncated_doc_ids,
        )
        for event in self._decode_answer(
            layout, prefill, options, started, report.as_stats(), should_stop
        ):
            if isinstance(event, DoneEvent) and self._cached is not None:
                self._cached.finish(report)  # the document-prefix entry, after the last token
                event.stats.update(report.as_stats())
            yield event

    def _cached_prefill(
        self, layout: PromptLayout, press: Press, question: str, namespace: str | None
    ) -> tuple[PrefillResult, CacheReport]:
        """Prefill through the KV store when there is one (hit, prefix hit or miss)."""
        if self._cached is None:
            return self.prefill(layout.input_ids, press), CacheReport(status="off")
        return self._cached.prefill(layout, press, question, namespace)

    def _decode_answer(
        self,
        layout: PromptLayout,
        prefill: PrefillResult,
        options: AnswerOptions,
        started: float,
        extra_stats: dict[str, Any],
        should_stop: Callable[[], bool] | None,
    ) -> Iterator[AnswerEvent]:
        generated: list[int] = []
        emitted = ""
        ttft: float | None = None
        timings: dict[str, float] = {}
        for token in self.decode_tokens(prefill, options.generation, should_stop, timings):
            if ttft is None:
                ttft = time.perf_counter() - started
            generated.append(token)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if len(text) > len(emitted) and not text.endswith("\ufffd"):  # hold back partial UTF-8
                yield TokenEvent(text=text[len(emitted) :])
                emitted = text
        answer = self.tokenizer.decode(generated, skip_special_tokens=True)
        if len(answer) > len(emitted):
            yield TokenEvent(text=answer[len(emitted) :])
        shares = document_keep_shares(prefill.keep_rate(), layout.doc_spans)
        citations = extract_citations(answer, layout.documents, shares)
        yield CitationsEvent(citations=citations)
        steps = timings.get("decode_steps", 0)
        stats = {
            "model": self.loaded.model_id,
            "device": str(self.device),
            "press": prefill.press_config["press"],
            "press_config": prefill.press_config,
            "budget": prefill.press_config.get("budget"),
            "prompt_tokens": layout.num_tokens,
            "kept_tokens": prefill.kept_tokens,
            "kept_tokens_per_layer": prefill.kept_tokens_per_layer,
            "prefill_tokens": prefill.processed_tokens,
            "prefill_s": round(prefill.prefill_s, 4),
            "compress_s": round(prefill.compress_s, 4),
            "ttft_s": round(ttft if ttft is not None else time.perf_counter() - started, 4),
            "decode_ms_per_token": round(1000 * timings.get("decode_s", 0.0) / steps, 3)
            if steps
            else None,
            "new_tokens": len(generated),
            "kv_bytes_full": prefill.kv_bytes_full,
            "kv_bytes_kept": prefill.kv_bytes_kept,
            "dropped_doc_ids": layout.dropped_doc_ids,
            "truncated_doc_ids": layout.truncated_doc_ids,
            "total_s": round(time.perf_counter() - started, 4),
            **extra_stats,
        }
        yield DoneEvent(answer=answer, citations=citations, stats=stats)

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
