"""Calibrating how attribution evidence combines, on held-out eval records.

``ragsnap eval`` stores each record's evidence matrices (``attribution.evidence``: overlap
and attention ``[S][D]``, question and named ``[D]``). A grid search picks the weights,
threshold, relative gap, caps and anchors that maximize the mean citation F1 against the
gold documents, averaged over the data sets given (so no set dominates), among the rules
whose citations of right answers are precise enough in every set
(``--min-precision-when-right``); each kind of evidence alone gets its own rule too.
``score`` applies the shipped defaults and fitted weights to other records (the evaluated
items). A data set may span several folders (``a,b``).

    python -m ragsnap.eval.citation_calibration fit runs/heldout_a runs/heldout_b1,runs/heldout_b2
    python -m ragsnap.eval.citation_calibration score --weights W.json runs/test_a
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from statistics import fmean
from typing import Any

from ragsnap.citations.attribution import AttributionWeights, select_from_scores

GRID = [round(0.1 * i, 1) for i in range(11)]  # overlap and question weights
ATTENTION_GRID = [round(0.2 * i, 1) for i in range(6)]  # coarser: 21 weightings, not 66
THRESHOLDS = [round(0.05 * i, 2) for i in range(2, 15)]
CAPS = (None, 1, 2, 3)  # documents per answer
TOP_KS = (1, 2, 3)  # documents per sentence
RATIOS = (0.0, 0.8)  # share of the answer's best score
# (anchor, anchor_ratio, named_anchors): none; the question's best document; with the
# documents nearly as relevant; the documents the question names by title when it names any
ANCHORS: tuple[tuple[bool, float | None, bool], ...] = (
    (False, None, False),
    *((True, r, n) for n in (False, True) for r in (None, 0.6, 0.7, 0.8, 0.9)),
)


def load_records(
    folder: Path, press: str = "ragsnap", budget: int | None = 256
) -> list[dict[str, Any]]:
    """Records of ``press`` at ``budget`` with stored evidence (one per item, last wins)."""
    found: dict[str, dict[str, Any]] = {}
    for line in (folder / "predictions.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if (
            record["press"] == press
            and record.get("budget") == budget
            and record.get("attribution")
        ):
            found[record["item_id"]] = record
    return list(found.values())


def record_scores(record: dict[str, Any], weights: AttributionWeights) -> list[list[float]]:
    """``[S][D]`` combined scores of ``record``'s stored evidence under ``weights``."""
    ev = record["attribution"]["evidence"]
    attention = ev["attention"]
    return [
        [
            weights.score(
                overlap[d], None if attention is None else attention[s][d], ev["question"][d]
            )
            for d in range(len(ev["question"]))
        ]
        for s, overlap in enumerate(ev["overlap"])
    ]


def cited(
    record: dict[str, Any],
    weights: AttributionWeights,
    scores: Sequence[Sequence[float]] | None = None,
) -> list[int]:
    """Document indices ``weights`` cite for ``record`` (union over its sentences), the
    same selection as :func:`ragsnap.citations.attribution.select_documents`."""
    out: list[int] = []
    rows = record_scores(record, weights) if scores is None else scores
    evidence = record["attribution"]["evidence"]
    named = evidence.get("named", ())  # absent in records of older runs
    for picks in select_from_scores(rows, weights, evidence["question"], named):
        out += [d for d, _ in picks if d not in out]
    return out


def cited_ids(
    record: dict[str, Any],
    weights: AttributionWeights,
    scores: Sequence[Sequence[float]] | None = None,
) -> set[str]:
    """The ids of the documents :func:`cited` picks."""
    ids = record["attribution"]["doc_ids"]
    return {ids[d] for d in cited(record, weights, scores)}


def f1(
    record: dict[str, Any],
    weights: AttributionWeights,
    scores: Sequence[Sequence[float]] | None = None,
) -> float | None:
    gold = set(record["gold_doc_ids"])
    if not gold:
        return None
    chosen = cited_ids(record, weights, scores)
    return 2 * len(chosen & gold) / (len(chosen) + len(gold))


def mean_f1(
    sets: Sequence[Sequence[dict[str, Any]]],
    weights: AttributionWeights,
    scores: Sequence[Sequence[Sequence[Sequence[float]]]] | None = None,
) -> float:
    """Mean over ``sets`` of each set's mean F1 (``scores``: the records' precomputed
    score matrices under ``weights``' evidence weights, set by set)."""
    per_set = []
    for i, records in enumerate(sets):
        values = [
            v
            for j, r in enumerate(records)
            if (v := f1(r, weights, None if scores is None else scores[i][j])) is not None
        ]
        per_set.append(fmean(values) if values else 0.0)
    return fmean(per_set)


def precision_when_right(
    records: Sequence[dict[str, Any]],
    weights: AttributionWeights,
    scores: Sequence[Sequence[Sequence[float]]] | None = None,
) -> float | None:
    """Mean precision of the citations of the records answered right (None: no such
    record cites anything)."""
    values = []
    for j, record in enumerate(records):
        gold = set(record["gold_doc_ids"])
        if not gold or not record["scores"].get("accuracy"):
            continue
        chosen = cited_ids(record, weights, None if scores is None else scores[j])
        if chosen:
            values.append(len(chosen & gold) / len(chosen))
    return fmean(values) if values else None


def _search(
    sets: Sequence[Sequence[dict[str, Any]]],
    evidence_weights: Sequence[tuple[float, ...]],
    anchors: Sequence[tuple[bool, float | None, bool]] = ANCHORS,
    min_precision_when_right: float = 0.0,
) -> tuple[float, AttributionWeights]:
    """The best selection rule (threshold, ratio, per-sentence and per-answer caps,
    anchors) for each ``(overlap, attention, question)`` weighting; the best of all. Ties
    keep the first found (the simpler rule: no ratio, fewer caps, fewer anchors). A rule
    whose precision on right answers is below ``min_precision_when_right`` in some set
    is passed over, unless no rule reaches it."""
    best: tuple[float, AttributionWeights] = (-1.0, AttributionWeights())
    fallback = best
    for o, a, q in evidence_weights:
        base = AttributionWeights(overlap=o, attention=a, question=q)
        scores = [[record_scores(r, base) for r in records] for records in sets]
        for (n, nr, nn), r, t, k, m in itertools.product(anchors, RATIOS, THRESHOLDS, TOP_KS, CAPS):
            w = replace(base, threshold=t, top_k=k, max_documents=m, ratio=r)
            w = replace(w, anchor=n, anchor_ratio=nr, named_anchors=nn)
            value = mean_f1(sets, w, scores)
            if value > fallback[0] + 1e-9:
                fallback = (value, w)
            if value > best[0] + 1e-9 and all(
                (p := precision_when_right(records, w, scores[i])) is None
                or p >= min_precision_when_right
                for i, records in enumerate(sets)
            ):
                best = (value, w)
    return best if best[0] >= 0 else fallback


def fit(
    sets: Sequence[Sequence[dict[str, Any]]], min_precision_when_right: float = 0.0
) -> dict[str, Any]:
    """Best combined weights (with and without attention evidence; both held to
    ``min_precision_when_right`` on every set), and the best rule for each kind of
    evidence alone."""
    weighted = [
        (o, a, abs(round(1.0 - o - a, 1)))
        for o, a in itertools.product(ATTENTION_GRID, ATTENTION_GRID)
        if o + a <= 1.0001
    ]
    floor = min_precision_when_right
    score, combined = _search(sets, weighted, min_precision_when_right=floor)
    # the same without attention evidence: what the attention pass (its cost) buys
    lexical, no_attention = _search(
        sets, [(o, 0.0, round(1.0 - o, 1)) for o in GRID], min_precision_when_right=floor
    )
    alone = {}
    for name, base in (("attention", (0.0, 1.0, 0.0)), ("overlap", (1.0, 0.0, 0.0))):
        value, w = _search(sets, [base], anchors=ANCHORS[:1])  # that evidence only
        alone[name] = {"f1": round(value, 4), "weights": asdict(w)}
    return {
        "combined": {"f1": round(score, 4), "weights": asdict(combined)},
        "without_attention": {"f1": round(lexical, 4), "weights": asdict(no_attention)},
        "alone": alone,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragsnap.eval.citation_calibration")
    parser.add_argument("action", choices=("fit", "score"))
    parser.add_argument(
        "folders", nargs="+", help="eval output folders, one per data set (a,b: one set)"
    )
    parser.add_argument("--weights", type=Path, help="score: a fit's JSON output")
    parser.add_argument("--press", default="ragsnap")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument(
        "--min-precision-when-right",
        type=float,
        default=0.8,
        help="fit: the precision a rule needs on right answers in every set (issue 13's "
        "target; 0: any)",
    )
    args = parser.parse_args(argv)
    sets = [
        [r for f in spec.split(",") for r in load_records(Path(f), args.press, args.budget)]
        for spec in args.folders
    ]
    if args.action == "fit":
        fitted = fit(sets, args.min_precision_when_right)
        print(json.dumps({"n": [len(s) for s in sets], **fitted}, indent=2))
        return 0
    fitted = json.loads(args.weights.read_text()) if args.weights else {}
    methods = {"default": AttributionWeights()}  # what the engine ships
    for name in ("combined", "without_attention"):
        if name in fitted:
            methods[name] = AttributionWeights(**fitted[name]["weights"])
    for name, entry in fitted.get("alone", {}).items():
        methods[name] = AttributionWeights(**entry["weights"])
    for folder, records in zip(args.folders, sets, strict=True):
        print(json.dumps({"data": str(folder), "n": len(records), **score(records, methods)}))
    return 0


def _set_f1(chosen: set[str], gold: set[str]) -> tuple[float, float | None]:
    """(F1, precision or None when nothing was chosen)."""
    hits = len(chosen & gold)
    return 2 * hits / (len(chosen) + len(gold)), (hits / len(chosen) if chosen else None)


def score(
    records: Sequence[dict[str, Any]], methods: dict[str, AttributionWeights]
) -> dict[str, Any]:
    """Mean citation F1 and precision (all items, and items answered right) per method:
    the stored baselines (``markers``, ``bm25_top2``) and ``methods`` applied to the evidence."""
    rows: dict[str, list[tuple[float, float | None, float | None]]] = {}
    for record in records:
        gold = set(record["gold_doc_ids"])
        if not gold:
            continue
        right = record["scores"].get("accuracy")
        chosen = {
            "markers": set(record["attribution"]["methods"]["markers"]),
            "bm25_top2": set(record["attribution"]["methods"]["bm25_top2"]),
        }
        for name, weights in methods.items():
            chosen[name] = cited_ids(record, weights)
        for name, docs in chosen.items():
            f, p = _set_f1(docs, gold)
            rows.setdefault(name, []).append((f, p, right))
    out: dict[str, Any] = {}
    for name, values in rows.items():
        precisions = [p for _, p, _ in values if p is not None]
        right_p = [p for _, p, r in values if p is not None and r]
        out[name] = {
            "f1": round(fmean(f for f, _, _ in values), 4),
            "precision": round(fmean(precisions), 4) if precisions else None,
            "precision_when_right": round(fmean(right_p), 4) if right_p else None,
            "n_right_cited": len(right_p),
        }
    out["accuracy"] = (
        round(fmean(float(r["scores"].get("accuracy") or 0) for r in records), 4)
        if records
        else None
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
