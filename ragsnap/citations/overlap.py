"""Lexical evidence: how much of an answer sentence a document sentence contains.

Each word is weighted by its inverse document frequency over the sentences of the prompt's
documents (rare words are evidence, common ones are not), so the score of a document
sentence is the IDF-weighted share of the answer sentence's content words it contains,
mixed with the share of its content bigrams (word order). The question gets its BM25
relevance per document, a prior that the answer alone cannot give for short answers.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from ragsnap.citations.sentences import content_words
from ragsnap.prompt.order import bm25_words, question_relevance

__all__ = ["SentenceIndex", "bm25_words", "question_relevance", "titles_named"]

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


_DISAMBIGUATION = re.compile(r"\s*\([^()]*\)\s*$")  # "Notorious (Duran Duran song)"


def titles_named(question: str, titles: Sequence[str]) -> list[bool]:
    """``[D]``: whether ``question`` names the document by its title (case-insensitive, as
    whole words, without a trailing parenthesized disambiguation; titles of fewer than
    three characters, or without a letter, never count). A question that names a
    document asks about it: "Which band formed first, Duran Duran or The Fratellis?".

    The longest name wins: a title found only inside another title's match ("Tropical
    fish" in "... Tropical Fish Hobbyist ...") is not named. A name that several titles
    share ("The Lone Ranger (1956 film)", "The Lone Ranger (2013 film)") names none of
    them: the question does not say which it means."""
    text = question.casefold()
    names = [_DISAMBIGUATION.sub("", title).casefold().strip() for title in titles]
    shared = Counter(names)
    spans: list[list[tuple[int, int]]] = []
    for name in names:
        ok = len(name) >= 3 and any(c.isalpha() for c in name) and shared[name] == 1
        found = re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", text) if ok else ()
        spans.append([m.span() for m in found])
    every = [span for found in spans for span in found]
    return [
        any(
            not any(a <= start and end <= b and (a, b) != (start, end) for a, b in every)
            for start, end in found
        )
        for found in spans
    ]
