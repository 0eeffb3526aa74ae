"""One answer on its own, in the caller's thread: prefill, decode, cite (the engine's
``stream``; the scheduler drives the same stages for many requests at once)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Protocol

import torch

from ragsnap.engine.events import AnswerEvent, CitationsEvent, DoneEvent, TokenEvent
from ragsnap.engine.prepared import AnswerOptions, PlannedAnswer, PreparedAnswer, TextStream
from ragsnap.engine.stopping import apply_stop
from ragsnap.prompt.documents import Document
from ragsnap.runtime.decode import DecodeRow, LogitsProcessor
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PromptLogits, Step, drain


class AnswerStages(Protocol):
    """The stages of an answer an engine offers (``RagSnapEngine``), as driven here."""

    runtime: ModelRuntime
    tokenizer: Any

    def lookup(
        self, question: str, documents: Sequence[Document], options: AnswerOptions, namespace: str
    ) -> PreparedAnswer | PlannedAnswer: ...

    def execute(self, planned: PlannedAnswer) -> Generator[Step, None, PreparedAnswer]: ...

    def logits_processor(
        self, prepared: PreparedAnswer | PlannedAnswer
    ) -> LogitsProcessor | None: ...

    def finish(
        self, prepared: PreparedAnswer, row: DecodeRow, ttft_s: float | None
    ) -> tuple[CitationsEvent, DoneEvent]: ...

    def store_pending(self, prepared: PreparedAnswer) -> None: ...


def stream_answer(
    engine: AnswerStages,
    question: str,
    documents: Sequence[Document],
    options: AnswerOptions,
    should_stop: Callable[[], bool] | None = None,
    namespace: str = "default",
) -> Iterator[AnswerEvent]:
    """Answer ``question`` over ``documents``: meta, token..., citations, done.

    Closing the iterator (or ``should_stop()`` returning True) stops generation after the
    current decode step. ``namespace`` separates tenants in the KV store. The answer ends
    before the first of ``options.generation.stop`` it meets, as through the server
    (:mod:`ragsnap.engine.stopping`).
    """
    if not options.generation.stop:
        yield from _decode(engine, question, documents, options, should_stop, namespace)
        return
    matched = threading.Event()

    def halt() -> bool:
        return matched.is_set() or (should_stop is not None and should_stop())

    events = _decode(engine, question, documents, options, halt, namespace)
    try:
        yield from apply_stop(events, options.generation.stop, matched.set)
    finally:
        events.close()


def _decode(
    engine: AnswerStages,
    question: str,
    documents: Sequence[Document],
    options: AnswerOptions,
    should_stop: Callable[[], bool] | None,
    namespace: str,
) -> Generator[AnswerEvent, None, None]:
    prepared, early = yield from _prepared(engine, question, documents, options, namespace)
    if early is None:
        yield prepared.meta()
    batch = engine.runtime.decode_batch()
    stop = (lambda _tokens: should_stop()) if should_stop is not None else None
    row = batch.add(
        0,
        prepared.prefill,
        options.generation,
        stop,
        engine.logits_processor(prepared),
        decode_compression=options.decode_compression,
        context=prepared.layout.input_ids,
    )
    text, ttft = (TextStream(engine.tokenizer), None) if early is None else early
    sent = early is not None  # the first token went out before compression
    try:
        for out in batch.run():
            if out.token is not None:
                ttft = ttft if ttft is not None else time.perf_counter() - prepared.started
                if sent:  # the same token the row picked: not sent again
                    sent = False
                elif delta := text.push(out.token):
                    yield TokenEvent(text=delta)
        if rest := text.flush():
            yield TokenEvent(text=rest)
        yield from engine.finish(prepared, row, ttft)
    finally:  # an iterator closed early still writes what the answer left to write
        engine.store_pending(prepared)


def _prepared(
    engine: AnswerStages,
    question: str,
    documents: Sequence[Document],
    options: AnswerOptions,
    namespace: str,
) -> Generator[AnswerEvent, None, tuple[PreparedAnswer, tuple[TextStream, float] | None]]:
    """The answer ready to decode; on the way, as the scheduler does, its meta event and
    first token once the prompt's last logits exist, when its row will pick that token (a
    greedy answer). Returns it with that token's text stream and time, or None."""
    found = engine.lookup(question, documents, options, namespace)
    if isinstance(found, PreparedAnswer):
        return found, None
    early: tuple[TextStream, float] | None = None
    steps = engine.execute(found)
    try:
        while True:
            try:
                with torch.inference_mode():
                    step = next(steps)
            except StopIteration as finished:
                return finished.value, early
            if not isinstance(step, PromptLogits) or early is not None:
                continue
            processor = engine.logits_processor(found)
            first = found.first_events(
                step.logits, engine.runtime.stop_ids, processor, engine.tokenizer
            )
            if first is not None:
                early = (first[1], time.perf_counter() - found.started)
                try:
                    yield from first[0]
                except GeneratorExit:  # the reader left: finish, so that the entries are
                    engine.store_pending(drain(steps))  # written as when it leaves later
                    raise
    finally:
        steps.close()
