"""The passages ``ragsnap bench reuse`` reads once and the questions it asks over them.

Each evaluation item (HotpotQA, BioASQ factoid, any format ``ragsnap eval`` loads) becomes
one passage: its gold documents first, then its other documents, joined and cut to about
``tokens`` tokens, with a needle sentence (its own number) placed at a sentence end near
the middle. The passage is the item's gold document for citations; its question and gold
answers are scored as ``ragsnap eval`` scores them (:func:`ragsnap.eval.metrics.score_answer`).
Items from several data sets are interleaved, so every pool mixes them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ragsnap.errors import ConfigError
from ragsnap.eval.datasets import guess_format, load_items
from ragsnap.eval.items import EvalItem
from ragsnap.prompt.documents import Document

# the formats whose items carry gold answers and gold documents the bench can score
REUSE_FORMATS = ("hotpotqa", "bioasq", "jsonl")
DEFAULT_TYPES = ("factoid", "short")  # BioASQ factoid, HotpotQA's short answers
# digits of a needle's number: ragsnap eval's 7 by default; the embedded model recalls a
# 7-digit needle among 8 passages in a third of held-out prompts even with the full cache
NEEDLE_DIGITS = 7


@dataclass(frozen=True)
class PoolPassage:
    """One passage of the pool, the item it came from, and its needle."""

    doc: Document
    item: EvalItem
    dataset: str
    needle_value: str
    needle_question: str
    needle_prefix: str


def load_bench_items(
    paths: list[Path],
    fmt: str | None,
    types: tuple[str, ...],
    skip: int,
    seed: int,
    count_tokens: Callable[[str], int] | None = None,
    tokens: int | None = None,
) -> list[tuple[str, EvalItem]]:
    """``(dataset, item)`` pairs: each data set's items of ``types`` after its first
    ``skip``, interleaved one by one across data sets (``fmt`` None: guessed per path).
    BioASQ items are padded with other questions' passages to about ``tokens`` tokens
    (counted by ``count_tokens``), as ``ragsnap eval --context-tokens`` pads them."""
    per_set: list[list[tuple[str, EvalItem]]] = []
    for path in paths:
        kind = fmt or guess_format(path)
        if kind not in REUSE_FORMATS:
            raise ConfigError(
                f"{path}: format {kind!r} has no gold answers to score here "
                f"(choose from: {', '.join(REUSE_FORMATS)})",
                field="format",
            )
        loaded = load_items(
            kind, path, seed=seed, types=types, context_tokens=tokens, count_tokens=count_tokens
        )
        usable = [i for i in loaded.items if i.answers and i.gold_doc_ids][skip:]
        if not usable:
            raise ConfigError(f"{path}: no usable {'/'.join(types)} items", field="data")
        per_set.append([(kind, item) for item in usable])
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*per_set))
    return [pair for pair in mixed if pair is not None]


def passage_of(
    tokenizer: Any,
    dataset: str,
    item: EvalItem,
    index: int,
    tokens: int,
    rng: random.Random,
    digits: int = NEEDLE_DIGITS,
) -> PoolPassage:
    """``item``'s passage of about ``tokens`` tokens (gold documents first), needle inside
    (a number of ``digits`` digits)."""
    from ragsnap.eval.niah import ANSWER_PREFIX, NEEDLE, QUESTION, _random_needle
    from ragsnap.prompt.assembly import encode_user_text

    gold = set(item.gold_doc_ids)
    ordered = sorted(item.documents, key=lambda d: d.id not in gold)  # stable: gold first
    texts: list[str] = []
    for doc in ordered:
        texts.append(doc.text.strip())
        if len(encode_user_text(tokenizer, " ".join(texts))) >= tokens:
            break
    ids = encode_user_text(tokenizer, " ".join(texts))
    text = tokenizer.decode(ids[:tokens])
    needle = _random_needle(rng)
    if digits != NEEDLE_DIGITS:
        needle = replace(needle, value=str(rng.randint(10 ** (digits - 1), 10**digits - 1)))
    cut = text.rfind(". ", 0, len(text) // 2) + 1  # the middle, at a sentence end
    text = f"{text[:cut]} {NEEDLE.format(key=needle.key, value=needle.value)}{text[cut:]}"
    title = next((d.title for d in ordered if d.title), f"passage {index}")
    return PoolPassage(
        doc=Document(id=f"p{index}", title=title, text=text),
        item=item,
        dataset=dataset,
        needle_value=needle.value,
        needle_question=QUESTION.format(key=needle.key),
        needle_prefix=ANSWER_PREFIX.format(key=needle.key),
    )


def build_passages(
    tokenizer: Any,
    items: list[tuple[str, EvalItem]],
    tokens: int,
    seed: int,
    digits: int = NEEDLE_DIGITS,
) -> list[PoolPassage]:
    """One :func:`passage_of` per item, ids ``p0 ..`` in order, needles of ``digits`` digits."""
    rng = random.Random(seed)
    return [
        passage_of(tokenizer, dataset, item, i, tokens, rng, digits)
        for i, (dataset, item) in enumerate(items)
    ]
