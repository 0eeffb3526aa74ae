"""Lexical evidence: how much of an answer sentence a document sentence contains.

Each word is weighted by its inverse document frequency over the sentences of the prompt's
documents (rare words are evidence, common ones are not), so the score of a document
sentence is the IDF-weighted share of the answer sentence's content words it contains,
mixed with the share of its content bigrams (word order). The question gets a BM25-like
relevance per document, a prior that the answer alone cannot give for short answers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from ragsnap.citations.sentences import content_words

BIGRAM_WEIGHT = 0.3  # bigrams catch copied phrases; unigrams carry most of the evidence


class SentenceIndex:
    """IDF statistics over a list of sentences (``texts``), one bag of words each."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.words = [set(content_words(t)) for t in texts]
        self.bigrams = [_bigrams(content_words(t)) for t in texts]
        df: Counter[str] = Counter(w for ws in self.words for w in ws)
        n = max(len(texts), 1)
        self._idf = {w: math.log(1.0 + n / c) for w, c in df.items()}
        self._unseen = math.log(1.0 + n)

    def idf(self, word: str) -> float:
        return self._idf.get(word, self._unseen)

    def overlap(self, query: str, sentence: int) -> float:
        """Weighted share of ``query``'s content found in sentence ``sentence``, in [0, 1]."""
        words = content_words(query)
        wanted = set(words)
        if not wanted:
            return 0.0
        total = sum(self.idf(w) for w in wanted)
        found = sum(self.idf(w) for w in wanted & self.words[sentence])
        unigram = found / total
        pairs = _bigrams(words)
        if not pairs:
            return unigram
        bigram = len(pairs & self.bigrams[sentence]) / len(pairs)
        return (1 - BIGRAM_WEIGHT) * unigram + BIGRAM_WEIGHT * bigram


def _bigrams(words: Sequence[str]) -> set[tuple[str, str]]:
    return set(zip(words, words[1:], strict=False))


def question_relevance(question: str, documents: Sequence[str]) -> list[float]:
    """BM25-like score of each document for ``question``, divided by the best (``[D]``, in
    [0, 1]; all zeros when no document shares a word with the question)."""
    bags = [Counter(content_words(d)) for d in documents]
    if not bags:
        return []
    n = len(bags)
    mean_len = max(sum(sum(b.values()) for b in bags) / n, 1.0)
    k1, b = 1.2, 0.75
    scores = []
    for bag in bags:
        length = sum(bag.values())
        score = 0.0
        for word in set(content_words(question)):
            tf = bag.get(word, 0)
            if tf:
                df = sum(1 for other in bags if word in other)
                idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
                score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / mean_len))
        scores.append(score)
    best = max(scores)
    return [s / best if best > 0 else 0.0 for s in scores]
