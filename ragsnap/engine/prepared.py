"""A request between its stages: options, a prefix hit to finish, a prefill ready to decode,
and the text and statistics of what it decoded."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.cache.report import CacheReport
from ragsnap.citations.options import CitationOptions
from ragsnap.compression import Press, make_press
from ragsnap.compression.decode_snapkv import DecodeSnapKV
from ragsnap.compression.lookahead import press_label
from ragsnap.engine.events import AnswerEvent, MetaEvent, TokenEvent
from ragsnap.engine.execute import PlannedPrompt
from ragsnap.engine.stats import AnswerStats
from ragsnap.prompt.assembly import (
    DEFAULT_DOCUMENT_ORDER,
    ChatContext,
    DocumentOrder,
    PromptLayout,
)
from ragsnap.runtime.decode import DecodeRow, LogitsProcessor
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.prefill import PrefillResult


@dataclass
class AnswerOptions:
    """Everything about one answer except its inputs (an engine's
    :meth:`~ragsnap.engine.engine.RagSnapEngine.default_options` fills them from its config)."""

    press: Press = field(default_factory=make_press)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    chat: ChatContext | None = None  # a chat's instructions and prior turns (prompt tail)
    citations: CitationOptions = field(default_factory=CitationOptions)
    # decode-phase SnapKV: long answers stay within the prompt's budget plus a slack
    decode_compression: DecodeSnapKV | None = None
    kept_tokens: bool = False  # the done event carries each document's kept-token map
    document_order: DocumentOrder = DEFAULT_DOCUMENT_ORDER  # see ragsnap.prompt.assembly


@dataclass
class PlannedAnswer:
    """A request looked up in the cache tiers: its plan is left to execute
    (:meth:`RagSnapEngine.execute`)."""

    prompt: PlannedPrompt
    options: AnswerOptions
    started: float
    question: str

    @property
    def layout(self) -> PromptLayout:
        return self.prompt.layout

    @property
    def report(self) -> CacheReport:
        plan = self.prompt.plan
        return CacheReport(status="off") if plan is None else plan.report

    def prepared(self, result: PrefillResult) -> PreparedAnswer:
        """This request ready to decode from ``result``."""
        return PreparedAnswer(
            self.layout, result, self.report, self.options, self.started, self.question
        )

    def first_events(
        self,
        logits: torch.Tensor,
        stop_ids: Collection[int],
        processor: LogitsProcessor | None,
        tokenizer: Any,
    ) -> tuple[list[AnswerEvent], TextStream] | None:
        """What to send before the press compresses the prompt, from its last logits
        ``[1, V]``: the meta event and the first token, with the text stream the answer
        goes on with, when its row will pick that same token (a greedy answer's argmax after
        its ``processor``, unless it ends the answer at once); None otherwise."""
        if not self.options.generation.greedy:
            return None
        if processor is not None:
            logits = processor([], logits)
        token = int(logits[0].argmax())
        if token in stop_ids:
            return None
        text = TextStream(tokenizer)
        events: list[AnswerEvent] = [self.meta()]
        if delta := text.push(token):
            events.append(TokenEvent(text=delta))
        return events, text

    def meta(self) -> MetaEvent:
        """The meta event before compression (its kept tokens not known yet)."""
        return _meta(self.layout, None, self.report.status)


@dataclass
class PendingAnswer(PlannedAnswer):
    """A request whose document prefix was found in the store: its tail is left to finish
    (:meth:`RagSnapEngine.finish_prefix_hits`, several at once)."""


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
        return _meta(self.layout, self.prefill.kept_tokens, self.report.status)

    def stats(
        self, row: DecodeRow, ttft_s: float | None, attribution_s: float, model: str, device: str
    ) -> AnswerStats:
        """The statistics of this request once ``row`` has decoded its answer."""
        layout, prefill, report = self.layout, self.prefill, self.report
        now = time.perf_counter()
        return AnswerStats(
            model=model,
            device=device,
            press=press_label(prefill.press_config),
            press_config=prefill.press_config,
            budget=prefill.press_config.get("budget"),
            prompt_tokens=layout.num_tokens,
            kept_tokens=prefill.kept_tokens,
            kept_tokens_per_layer=prefill.kept_tokens_per_layer,
            prefill_tokens=prefill.processed_tokens,
            prefill_s=round(prefill.prefill_s, 4),
            compress_s=round(prefill.compress_s, 4),
            ttft_s=round(ttft_s if ttft_s is not None else now - self.started, 4),
            decode_ms_per_token=(
                round(1000 * row.decode_s / len(row.tokens), 3) if row.steps else None
            ),
            new_tokens=len(row.tokens),
            decode_s=round(row.decode_s, 4),
            citations_mode=self.options.citations.mode,
            attribution_s=round(attribution_s, 4),
            kv_bytes_full=prefill.kv_bytes_full,
            kv_bytes_kept=prefill.kv_bytes_kept,
            total_s=round(now - self.started, 4),
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


def _meta(layout: PromptLayout, kept_tokens: int | None, cache: str) -> MetaEvent:
    return MetaEvent(
        prompt_tokens=layout.num_tokens,
        kept_tokens=kept_tokens,
        cache=cache,
        documents=[
            {"index": i + 1, "id": d.id, "title": d.title} for i, d in enumerate(layout.documents)
        ],
        dropped_doc_ids=layout.dropped_doc_ids,
        truncated_doc_ids=layout.truncated_doc_ids,
    )
