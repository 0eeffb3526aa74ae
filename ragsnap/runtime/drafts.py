"""Draft a decode row's next tokens for the model to check: expected tokens, prompt n-grams.

Two sources, tried in this order:

- **expected tokens**: the answer's first tokens as a lookahead press drafted them on the
  full cache before compressing it. The compressed cache mostly agrees with the full one,
  so a row feeds them after its first token and keeps most of them.
- **prompt n-grams** (opt-in): a RAG answer copies names, dates and phrases from its
  documents. When the answer's last ``n`` tokens also occur in the prompt (or earlier in
  the answer), the tokens that followed them there are a guess at what comes next. When
  that occurrence is only ``p`` tokens back (the answer repeats itself with period ``p``:
  small models loop), the guess continues the repetition past the context's end, so a
  looping row takes up to its whole draft budget per pass instead of ``p`` tokens.

The decode loop feeds a draft with the row's next token in one pass and keeps the longest
prefix the model itself would have picked (greedy), so the answer is the one plain
decoding gives. Whether it pays depends on what a pass over a few more tokens costs:
``ragsnap bench speculate`` measures it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# the most tokens a row drafts per step where nothing else is said (serve, ask): the
# tokens the default press drafts on the full cache
DEFAULT_SPECULATE = 8

# the longest and shortest n-gram looked up (longer matches are tried first)
MAX_NGRAM = 3
MIN_NGRAM = 2


class Drafts:
    """The drafts of one row: its expected tokens and the n-gram index of its context (its
    prompt, then its answer so far).

    ``draft(k)`` proposes up to ``k`` tokens: the next expected ones while the answer
    agrees with them; else, with ``ngrams``, what followed the latest earlier occurrence of
    the context's last ``n`` tokens, for the longest ``n`` in ``[MIN_NGRAM, MAX_NGRAM]``
    that occurs, repeated with the period between the two occurrences where the context
    ends first. Drafts stop before any token in ``stop_ids``.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        stop_ids: Iterable[int] = (),
        expected: Sequence[int] = (),
        ngrams: bool = True,
    ) -> None:
        self.tokens: list[int] = []
        self.stop_ids = frozenset(stop_ids)
        self.answer_start = len(prompt)
        self.expected = list(expected)
        self.ngrams = ngrams
        # n-gram -> the position just after its latest occurrence that has a successor
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(prompt)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context."""
        if not self.ngrams:  # no index to keep up
            self.tokens.extend(tokens)
            return
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending just before ``token``
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._next[tuple(self.tokens[end - n : end])] = end

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow the context (empty when nothing matches)."""
        if k < 1:
            return []
        done = len(self.tokens) - self.answer_start
        if done < len(self.expected) and self.tokens[self.answer_start :] == self.expected[:done]:
            return self._until_stop(self.expected[done : done + k])
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1) if self.ngrams else ():
            if len(self.tokens) <= n:
                continue
            start = self._next.get(tuple(self.tokens[-n:]))
            if start is None:
                continue
            period = len(self.tokens) - start  # >= 1: the latest occurrence has a successor
            repeated = [self.tokens[start + i % period] for i in range(k)]
            if out := self._until_stop(repeated):
                return out
        return []

    def _until_stop(self, tokens: list[int]) -> list[int]:
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                return tokens[:i]
        return tokens
