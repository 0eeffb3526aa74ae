"""Stop sequences: the answer ends just before the first occurrence of any of them.

The engine decodes tokens; a stop string can end in the middle of a token or span
several, so matching happens on the decoded text. Text that could still become the start
of a stop string is held back until the next piece decides it. When one matches, the
engine is asked to stop (``should_stop``) and finishes with its usual citations and
statistics, which are rewritten for the cut answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ragsnap.citations import Citation, cited_indices
from ragsnap.engine.events import AnswerEvent, CitationsEvent, DoneEvent, TokenEvent


class StopMatcher:
    """Feeds answer text piece by piece; returns what may be shown now.

    ``matched`` is the stop string found (None until then); ``text`` the answer so far,
    cut before the stop string once one matched.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""
        self.matched: str | None = None
        self._shown = 0

    def feed(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        self.text += piece
        found = [(self.text.find(s), s) for s in self.stop]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.matched = min(found)
            self.text = self.text[:at]
            return self._show(at)
        return self._show(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The held-back tail once the answer ended without a match."""
        return self._show(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest end of ``text`` that starts some stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _show(self, end: int) -> str:
        end = max(end, self._shown)
        piece, self._shown = self.text[self._shown : end], end
        return piece


def cited_in(answer: str, citations: Sequence[Citation]) -> list[Citation]:
    """The citations whose ``[n]`` marker is still in ``answer``."""
    kept = set(cited_indices(answer))
    return [c for c in citations if c.index in kept]


class StopFilter:
    """Rewrites an answer's events, one at a time, for stop strings: text is cut before the
    first match, the citations and the ``done`` event follow the cut answer (its stats gain
    ``stop_sequence``: the string matched, or None). ``matched`` tells the decoder to stop."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.matcher = StopMatcher(stop)

    @property
    def matched(self) -> str | None:
        return self.matcher.matched

    def push(self, event: AnswerEvent) -> list[AnswerEvent]:
        matcher = self.matcher
        if isinstance(event, TokenEvent):
            text = matcher.feed(event.text)
            return [TokenEvent(text=text)] if text else []
        if isinstance(event, CitationsEvent):
            rest = matcher.flush()
            cut = CitationsEvent(citations=cited_in(matcher.text, event.citations))
            return [TokenEvent(text=rest), cut] if rest else [cut]
        if isinstance(event, DoneEvent):
            model = event.model_answer if event.model_answer is not None else event.answer
            answer = matcher.text if matcher.matched is not None else model
            stats = replace(event.stats, stop_sequence=matcher.matched)
            if matcher.matched is not None:
                stats.finish_reason = "stop"
            citations = cited_in(answer, event.citations)
            # the verdict travels on (issue 43); an abstention keeps its text
            abstained = event.model_answer is not None
            return [
                replace(
                    event,
                    answer=event.answer if abstained else answer,
                    model_answer=answer if abstained else None,
                    citations=citations,
                    stats=stats,
                    answer_with_markers=None,
                )
            ]
        return [event]


def apply_stop(
    events: Iterator[AnswerEvent], stop: Sequence[str], request_stop: Callable[[], None]
) -> Iterator[AnswerEvent]:
    """``events`` through a :class:`StopFilter`; calls ``request_stop()`` once, when a stop
    string matched, so the engine ends after its current decode step."""
    stopper = StopFilter(stop)
    for event in events:
        before = stopper.matched
        yield from stopper.push(event)
        if before is None and stopper.matched is not None:
            request_stop()
