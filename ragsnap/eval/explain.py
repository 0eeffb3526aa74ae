"""Why an answer got its score: the forms the matcher compared, in one line per item.

The matcher (:mod:`ragsnap.eval.metrics`) counts a gold form as found only when its
normalized words occur as whole words in the answer. A gold form hidden inside a longer
word (gold ``XIa`` in the answer ``FXIa``) is not found; the explanation names such near
misses so a reader of report.md can see why a plausible answer scored 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ragsnap.eval.metrics import (
    MAX_FACTOID_CANDIDATES,
    contains,
    normalize,
    normalize_words,
    split_candidates,
    yesno_label,
)


def near_misses(answer: str, forms: Sequence[str]) -> list[str]:
    """``'answer word' ⊃ 'gold'`` for each one-word gold form found only inside a longer
    answer word (at least two characters of gold, so single letters do not flood)."""
    words = set(normalize_words(answer))
    found = []
    for form in forms:
        target = normalize_words(form)
        if len(target) != 1 or len(target[0]) < 2 or target[0] in words:
            continue
        found += [f"'{w}' ⊃ '{target[0]}'" for w in sorted(words) if target[0] in w]
    return found


def _quoted(forms: Sequence[str], limit: int = 6) -> str:
    shown = [f"'{normalize(f)}'" for f in forms[:limit] if normalize(f)]
    more = f" +{len(forms) - limit} more" if len(forms) > limit else ""
    return "[" + ", ".join(shown) + more + "]"


def _no_match(answer: str, forms: Sequence[str]) -> str:
    text = f"no gold form {_quoted(forms)} occurs as whole words in '{normalize(answer)}'"
    misses = near_misses(answer, forms)
    if misses:
        text += f"; near miss inside a word (not accepted): {', '.join(misses[:3])}"
    return text


def _factoid(answer: str, synonyms: Sequence[str]) -> str:
    candidates = split_candidates(answer)[:MAX_FACTOID_CANDIDATES]
    for rank, candidate in enumerate(candidates, start=1):
        matched = next((s for s in synonyms if contains(candidate, s)), None)
        if matched is not None:
            kind = "strict (first candidate)" if rank == 1 else f"lenient (candidate {rank})"
            return f"{kind}: '{normalize(candidate)}' contains gold '{normalize(matched)}'"
    anywhere = next((s for s in synonyms if contains(answer, s)), None)
    if anywhere is not None:
        return (
            f"accuracy only: gold '{normalize(anywhere)}' is in the answer but in none of "
            f"its first {MAX_FACTOID_CANDIDATES} candidates"
        )
    return f"candidates {_quoted(candidates)}: " + _no_match(answer, synonyms)


def _list(answer: str, groups: Sequence[Sequence[str]]) -> str:
    items = split_candidates(answer)
    marks = []
    for group in groups:
        hit = next((i for i in items if any(contains(i, s) for s in group)), None)
        name = normalize(group[0]) if group else "?"
        marks.append(f"'{name}' " + (f"found in '{normalize(hit)}'" if hit else "missing"))
    found = sum(m.endswith("missing") is False for m in marks)
    return f"{found}/{len(groups)} entities named in {len(items)} answer items: " + "; ".join(
        marks[:8]
    )


def explain_score(
    item_type: str, answer: str, answers: Sequence[str], groups: Sequence[Sequence[str]] = ()
) -> str:
    """One line saying why :func:`ragsnap.eval.metrics.score_answer` scored ``answer`` so."""
    if item_type == "yesno":
        label = yesno_label(answer)
        gold = normalize(answers[0]) if answers else ""
        if label is None:
            return f"no yes/no/maybe word in the answer; gold '{gold}'"
        verdict = "right" if label == gold else "wrong"
        return f"parsed label '{label}' (first yes/no/maybe word), gold '{gold}': {verdict}"
    if item_type == "factoid":
        return _factoid(answer, answers)
    if item_type == "list":
        return _list(answer, groups)
    if item_type == "summary":
        return f"ROUGE-L against the closest of {len(answers)} ideal answers"
    if item_type == "needle":
        value = answers[0] if answers else ""
        runs = re.findall(r"\d+", answer)
        if value in runs:
            return f"value {value} found as a whole digit run"
        return f"value {value} not among the digit runs {runs[:5]}"
    matched = next((a for a in answers if contains(answer, a)), None)
    if matched is not None:
        return f"gold '{normalize(matched)}' found as whole words"
    return _no_match(answer, answers)
