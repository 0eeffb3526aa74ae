"""Scores of ``ragsnap bench reuse``: each answer as ``ragsnap eval`` scores it, and the
paired difference of every recompute share against the cold run, with its interval.

Per answer: ``accuracy`` (:func:`ragsnap.eval.metrics.score_answer`: a gold answer found in
the answer; needle questions: the needle's number) and ``citation_f1`` (the eval's default
attribution, ``cite_combined_f1`` of :func:`ragsnap.eval.citation_eval.citation_methods`,
against the item's passage). Per share: the mean of ``share - cold`` over the same
questions with the eval's percentile bootstrap 95% interval
(:func:`ragsnap.eval.confidence.bootstrap_ci`) and the exact sign test of the questions
where one side scored higher.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ragsnap.eval.citation_eval import citation_methods
from ragsnap.eval.confidence import bootstrap_ci, paired_counts, sign_test
from ragsnap.eval.metrics import score_answer
from ragsnap.prompt.assembly import PromptLayout
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PrefillResult

# the answer scores every run carries (needle questions have no citation score)
ANSWER_SCORES = ("accuracy", "citation_f1")


def answer_scores(
    runtime: ModelRuntime,
    layout: PromptLayout,
    question: str,
    prefill: PrefillResult,
    tokens: Sequence[int],
    item_type: str,
    answers: Sequence[str],
    gold_ids: Sequence[str],
) -> dict[str, float | None]:
    """``accuracy`` and ``citation_f1`` of one answer (``citation_f1`` None for needles)."""
    answer = runtime.tokenizer.decode(list(tokens), skip_special_tokens=True)
    accuracy = score_answer(item_type, answer, answers).get("accuracy")
    if item_type == "needle":
        return {"accuracy": accuracy, "citation_f1": None}
    cites, _, _ = citation_methods(
        runtime,
        layout,
        question,
        prefill,
        tokens,
        gold_ids,
        accuracy,
        answers=answers if item_type in ("factoid", "short") else (),
    )
    return {"accuracy": accuracy, "citation_f1": cites["cite_combined_f1"]}


def paired_difference(cold: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """Mean of ``other - cold`` (same questions, in order), its bootstrap 95% interval
    (None under 2 questions), the questions each side won, and the sign test's p-value."""
    diffs = [b - a for a, b in zip(cold, other, strict=True)]
    won_cold, won_other = paired_counts(list(zip(cold, other, strict=True)))
    ci = bootstrap_ci(diffs)
    p = sign_test(won_other, won_cold)
    return {
        "mean": round(statistics.fmean(diffs), 4) if diffs else None,
        "ci95": list(ci) if ci is not None else None,
        "better": won_other,
        "worse": won_cold,
        "sign_p": round(p, 4) if p is not None else None,
    }


def _values(rows: Sequence[dict[Any, Any]], run: str, score: str) -> list[float]:
    return [float(r[run][score]) for r in rows if r[run].get(score) is not None]


def score_summary(rows: Sequence[dict[Any, Any]], runs: Sequence[str]) -> dict[str, Any]:
    """Per score of :data:`ANSWER_SCORES`: the cold run's mean and n, and per run in
    ``runs`` its mean and :func:`paired_difference` against cold. ``rows`` hold ``"cold"``
    and each run as ``{score: value or None}`` (a score missing in a row leaves it out)."""
    out: dict[str, Any] = {}
    for score in ANSWER_SCORES:
        scored = [r for r in rows if r["cold"].get(score) is not None]
        cold = _values(scored, "cold", score)
        entry: dict[str, Any] = {
            "n": len(cold),
            "cold": round(statistics.fmean(cold), 4) if cold else None,
        }
        for run in runs:
            other = _values(scored, run, score)
            entry[run] = {
                "mean": round(statistics.fmean(other), 4) if other else None,
                "minus_cold": paired_difference(cold, other) if other else None,
            }
        out[score] = entry
    return out


def run_summary(rows: list[dict[Any, Any]], runs: list[str], has_concat: bool) -> dict[str, Any]:
    """Per run: speed, fidelity and needles; answers and citations against cold with
    intervals (questions with gold answers only; also per data set)."""
    needles = [r for r in rows if r["needle"]]
    asked = [r for r in rows if not r["needle"]]
    base_kl = statistics.fmean(r["0.0"]["kl"] for r in rows) if has_concat else None
    out: dict[str, Any] = {
        "needle_found_cold": _rate(r["cold"]["accuracy"] for r in needles),
        # per run, needles found minus found cold, paired by question, with its interval
        "needle_minus_cold": {
            run: paired_difference(
                [float(r["cold"]["accuracy"]) for r in needles],
                [float(r[run]["accuracy"]) for r in needles],
            )
            for run in runs
        }
        if needles
        else None,
        "scores": score_summary(asked, runs) if asked else None,
        "scores_by_dataset": {
            d: score_summary([r for r in asked if r["dataset"] == d], runs)
            for d in sorted({r["dataset"] for r in asked})
        },
        "shares": {},
    }
    for run in runs:
        stats = [r[run] for r in rows]
        kl = statistics.fmean(s["kl"] for s in stats)
        out["shares"][run] = {
            "ttft_s_median": round(statistics.median(s["ttft_s"] for s in stats), 4),
            "ttft_speedup_median": round(
                statistics.median(r["cold_s"] / r[run]["ttft_s"] for r in rows), 2
            ),
            "kl_mean": round(kl, 5),
            "kl_over_concat": None if not base_kl else round(kl / base_kl, 3),
            "answer_agreement": _rate(s["match"] for s in stats),
            "top1_agreement": round(statistics.fmean(s["top1"] for s in stats), 3),
            "accuracy": _mean(r[run]["accuracy"] for r in asked),
            "citation_f1": _mean(r[run]["citation_f1"] for r in asked),
            "needle_found": _rate(r[run]["accuracy"] for r in needles),
            "recomputed_tokens_mean": round(statistics.fmean(s["recomputed"] for s in stats), 1),
        }
    return out


def _mean(values: Any) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return round(statistics.fmean(kept), 4) if kept else None


def _rate(flags: Any) -> float | None:
    values = [bool(f) for f in flags]
    return round(sum(values) / len(values), 3) if values else None
