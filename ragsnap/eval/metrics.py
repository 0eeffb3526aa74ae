"""Scoring one answer: answer correctness by item type, citations, and what the press kept.

Generated answers are sentences, not bare entities, so matching is by normalized
containment: a gold string counts as found when its normalized words appear as a
contiguous run in the normalized answer (or candidate). Normalization lowercases,
removes ``[n]`` citation markers, punctuation and the articles a/an/the, and collapses
whitespace. Every function returns plain numbers (or None where undefined).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

_CITATION = re.compile(r"\[\d{1,4}(?:\s*,\s*\d{1,4})*\]")
_ARTICLES = {"a", "an", "the"}
# candidate separators for factoid / list answers: new lines, bullets, ; , and "or"/"and"
_SPLIT = re.compile(r"\n+|;|,|\s+(?:or|and)\s+|\s[-*\u2022]\s+|\.\s+", re.IGNORECASE)
_BULLET = re.compile(r"^(?:[-*\u2022]|\d{1,2}[.)])\s+")
_DIGITS = re.compile(r"\d+")
MAX_FACTOID_CANDIDATES = 5  # BioASQ lets a system rank up to five entities


def normalize_words(text: str) -> list[str]:
    """Lowercase words without citation markers, punctuation or articles."""
    text = unicodedata.normalize("NFKC", _CITATION.sub(" ", text)).lower()
    text = "".join(" " if unicodedata.category(ch).startswith(("P", "S")) else ch for ch in text)
    return [w for w in text.split() if w not in _ARTICLES]


def normalize(text: str) -> str:
    """:func:`normalize_words` joined by single spaces."""
    return " ".join(normalize_words(text))


def contains(haystack: str, needle: str) -> bool:
    """True when ``needle``'s normalized words occur contiguously in ``haystack``'s.

    An empty (after normalization) ``needle`` is never found.
    """
    words, target = normalize_words(haystack), normalize_words(needle)
    if not target or len(target) > len(words):
        return False
    n = len(target)
    return any(words[i : i + n] == target for i in range(len(words) - n + 1))


def contains_any(text: str, synonyms: Iterable[str]) -> bool:
    return any(contains(text, s) for s in synonyms)


def split_candidates(answer: str) -> list[str]:
    """Ranked answer candidates: the answer split at new lines, bullets, ``;``, ``,``,
    sentence ends and ``or``/``and``; empty pieces dropped."""
    pieces = [_BULLET.sub("", p.strip()).strip() for p in _SPLIT.split(_CITATION.sub(" ", answer))]
    return [p for p in pieces if normalize(p)]


# -- yes / no -------------------------------------------------------------------------


YESNO_LABELS = ("yes", "no", "maybe")  # "maybe": PubMedQA's third answer


def yesno_label(answer: str) -> str | None:
    """``"yes"``, ``"no"`` or ``"maybe"``, whichever word comes first in the answer; None
    if none does (a BioASQ "maybe" is simply wrong: its gold is yes or no)."""
    for word in normalize_words(answer):
        if word in YESNO_LABELS:
            return word
    return None


def macro_f1(gold: Sequence[str], predicted: Sequence[str | None], labels: Sequence[str]) -> float:
    """Mean over ``labels`` of each label's F1 (a missing prediction is wrong for every label)."""
    scores = []
    for label in labels:
        tp = sum(1 for g, p in zip(gold, predicted, strict=True) if g == label and p == label)
        fp = sum(1 for g, p in zip(gold, predicted, strict=True) if g != label and p == label)
        fn = sum(1 for g, p in zip(gold, predicted, strict=True) if g == label and p != label)
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


# -- factoid / list -------------------------------------------------------------------


def factoid_scores(answer: str, synonyms: Sequence[str]) -> dict[str, float]:
    """Strict (first candidate), lenient (any of the first five) and reciprocal rank."""
    rank = 0
    for i, candidate in enumerate(split_candidates(answer)[:MAX_FACTOID_CANDIDATES], start=1):
        if contains_any(candidate, synonyms):
            rank = i
            break
    return {
        "factoid_strict": float(rank == 1),
        "factoid_lenient": float(rank > 0),
        "factoid_mrr": 1.0 / rank if rank else 0.0,
    }


def list_scores(answer: str, groups: Sequence[Sequence[str]]) -> dict[str, float]:
    """Precision (answer items naming an expected entity), recall (expected entities
    named) and F1. An empty answer scores 0 on all three."""
    items = split_candidates(answer)
    if not items or not groups:
        return {"list_precision": 0.0, "list_recall": 0.0, "list_f1": 0.0}
    right = sum(1 for item in items if any(contains_any(item, g) for g in groups))
    found = sum(1 for g in groups if any(contains_any(item, g) for item in items))
    precision, recall = right / len(items), found / len(groups)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"list_precision": precision, "list_recall": recall, "list_f1": f1}


# -- summaries ------------------------------------------------------------------------


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(answer: str, references: Sequence[str]) -> float:
    """ROUGE-L F1 (longest common word subsequence), best over ``references``."""
    words = normalize_words(answer)
    best = 0.0
    for reference in references:
        ref = normalize_words(reference)
        lcs = _lcs_length(words, ref)
        if lcs:
            precision, recall = lcs / len(words), lcs / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# -- needles --------------------------------------------------------------------------


def needle_scores(answer: str, value: str) -> dict[str, float]:
    """Exact: the value appears as a whole digit run. Partial: the largest share of the
    value's leading digits that some digit run of the answer reproduces."""
    runs = _DIGITS.findall(answer)
    best = 0
    for run in runs:
        shared = 0
        for x, y in zip(run, value, strict=False):
            if x != y:
                break
            shared += 1
        best = max(best, shared)
    return {
        "needle_accuracy": float(value in runs),
        "needle_partial": best / len(value) if value else 0.0,
    }


# -- citations and kept evidence ------------------------------------------------------


def kept_share(keep_rate: Sequence[float], spans: Sequence[tuple[int, int]]) -> float | None:
    """Token-weighted mean of ``keep_rate`` over ``spans`` (None when they hold no tokens)."""
    total = sum(e - s for s, e in spans)
    if total <= 0:
        return None
    return sum(float(sum(keep_rate[s:e])) for s, e in spans) / total


def score_answer(
    item_type: str, answer: str, answers: Sequence[str], groups: Sequence[Sequence[str]] = ()
) -> dict[str, Any]:
    """Every correctness score that applies to an item of ``item_type``.

    ``accuracy`` is the headline: yes/no label right, gold answer found (factoid: anywhere
    in the answer; short), or needle exact; list and summary items have none.
    """
    scores: dict[str, Any] = {}
    if item_type == "yesno":
        label = yesno_label(answer)
        gold = normalize(answers[0]) if answers else ""
        scores.update(yesno_pred=label, yesno_gold=gold, yesno_accuracy=float(label == gold))
        scores["accuracy"] = scores["yesno_accuracy"]
    elif item_type == "factoid":
        scores.update(factoid_scores(answer, answers))
        scores["accuracy"] = float(contains_any(answer, answers))
    elif item_type == "list":
        scores.update(list_scores(answer, groups))
    elif item_type == "summary":
        scores["rouge_l"] = rouge_l(answer, answers)
    elif item_type == "needle":
        scores.update(needle_scores(answer, answers[0] if answers else ""))
        scores["accuracy"] = scores["needle_accuracy"]
    else:  # "short": a free-form short answer, right when it names a gold answer
        scores["accuracy"] = float(contains_any(answer, answers))
    return scores
