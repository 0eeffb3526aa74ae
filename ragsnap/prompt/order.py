"""The order of a prompt's documents, and the prompt a request gets.

By default the documents are laid out by BM25 relevance to the question, the most
relevant last, next to the question (small models read the nearest document); ``given``
keeps them as listed; ``stable`` is relevance the first time a document set is seen and
that first layout afterwards (the engine replays it from the cache tiers' records). The
relevance is BM25 as the retriever computes it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ragsnap.errors import ConfigError
from ragsnap.prompt.assembly import ChatContext, DocumentOrder, PromptLayout, assemble_prompt
from ragsnap.prompt.documents import Document

# BM25 as the retriever computes it (bm25s, Lucene variant): the same words (two or more
# word characters, lowercased, Lucene's English stopwords removed) and the same constants,
# so the question prior ranks documents exactly as the ``bm25_top2`` baseline does
_BM25_WORD = re.compile(r"(?u)\b\w\w+\b")
_BM25_STOPWORDS = frozenset(
    """a an and are as at be but by for if in into is it no not of on or such that the their
    then there these they this to was will with""".split()
)
BM25_K1, BM25_B = 1.5, 0.75


def bm25_words(text: str) -> list[str]:
    """The terms BM25 indexes for ``text`` (duplicates kept)."""
    return [w for w in _BM25_WORD.findall(text.lower()) if w not in _BM25_STOPWORDS]


def question_relevance(question: str, documents: Sequence[str]) -> list[float]:
    """BM25 score of each document for ``question`` (Lucene variant, over these documents
    only), divided by the best: ``[D]`` in [0, 1], all zeros when no document shares a
    term with the question. Ranks like :class:`ragsnap.retrieval.bm25.BM25Index`."""
    bags = [Counter(bm25_words(d)) for d in documents]
    if not bags:
        return []
    n = len(bags)
    mean_len = max(sum(sum(b.values()) for b in bags) / n, 1.0)
    df: Counter[str] = Counter(w for bag in bags for w in bag)
    terms = bm25_words(question)  # a repeated word counts again, as in bm25s
    scores = []
    for bag in bags:
        norm = BM25_K1 * (1 - BM25_B + BM25_B * sum(bag.values()) / mean_len)
        score = 0.0
        for word in terms:
            tf = bag.get(word, 0)
            if tf:
                idf = math.log(1.0 + (n - df[word] + 0.5) / (df[word] + 0.5))
                score += idf * tf / (tf + norm)
        scores.append(score)
    best = max(scores)
    return [s / best if best > 0 else 0.0 for s in scores]


def fit_prompt(
    tokenizer: Any,
    context_length: int,
    question: str,
    documents: Sequence[Document],
    max_new_tokens: int,
    order: DocumentOrder,
    *,
    answer_prefix: str = "",
    chat: ChatContext | None = None,
) -> PromptLayout:
    """The prompt of a request: the documents in ``order``, cut to what leaves room for
    ``max_new_tokens`` in the model's ``context_length``."""
    budget = context_length - max_new_tokens
    if budget <= 0:  # say what to change, not a negative number of prompt tokens
        raise ConfigError(
            f"max_new_tokens {max_new_tokens} leaves no room for the prompt: "
            f"the model's context is {context_length} tokens",
            field="max_new_tokens",
        )
    relevance = None
    if order in ("relevance", "stable"):  # a stable order's first layout is by relevance
        relevance = question_relevance(question, [f"{d.title}\n{d.text}" for d in documents])
    return assemble_prompt(
        tokenizer,
        question,
        documents,
        max_prompt_tokens=budget,
        answer_prefix=answer_prefix,
        chat=chat,
        relevance=relevance,
    )
