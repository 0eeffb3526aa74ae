"""Per press x budget summaries of the prediction records: the ``runs`` of metrics.json."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from statistics import fmean
from typing import Any

from ragsnap.eval.confidence import CI_SCORES, bootstrap_ci, sign_test
from ragsnap.eval.metrics import macro_f1

# mean over the records that have a value (None = not applicable to that item)
MEAN_SCORES = (
    "accuracy",
    "yesno_accuracy",
    "factoid_strict",
    "factoid_lenient",
    "factoid_mrr",
    "list_precision",
    "list_recall",
    "list_f1",
    "rouge_l",
    "needle_accuracy",
    "needle_partial",
    "agreement",
    "kl",
    "nll_gap",
    "citation_precision",
    "citation_recall",
    "gold_kept_share",
    "needle_kept_share",
)
# higher is better and the full cache is the reference: retention = metric / full metric
RETAINED = (
    "accuracy",
    "yesno_accuracy",
    "yesno_macro_f1",
    "factoid_strict",
    "factoid_lenient",
    "factoid_mrr",
    "list_precision",
    "list_recall",
    "list_f1",
    "rouge_l",
    "needle_accuracy",
    "needle_partial",
    "citation_precision",
    "citation_recall",
)
TIMINGS = (
    "prefill_s",
    "compress_s",
    "decode_s",
    "decode_ms_per_token",
    "fidelity_s",
    "attribution_s",
    "attribution_share",
)


def _mean(values: Sequence[Any]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return round(fmean(present), 6) if present else None


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of one press x budget over ``records`` (scalars only; absent when undefined)."""
    metrics: dict[str, Any] = {}
    cite_keys = sorted({k for r in records for k in r["scores"] if k.startswith("cite_")})
    for key in (*MEAN_SCORES, *cite_keys):
        value = _mean([r["scores"].get(key) for r in records])
        if value is not None:
            metrics[key] = value
    yesno = [r["scores"] for r in records if r["type"] == "yesno"]
    if yesno:
        gold = [s["yesno_gold"] for s in yesno]
        # PubMedQA's macro-F1 is over yes/no/maybe; BioASQ's over yes/no
        three = "maybe" in gold or any(r.get("dataset") == "pubmedqa" for r in records)
        labels = ("yes", "no", "maybe") if three else ("yes", "no")
        metrics["yesno_macro_f1"] = round(
            macro_f1(gold, [s["yesno_pred"] for s in yesno], labels), 6
        )
    needles = [r for r in records if r["type"] == "needle"]
    for axis in ("length", "depth"):
        groups: dict[Any, list[float]] = defaultdict(list)
        for r in needles:
            if r["meta"].get(axis) is not None:
                groups[r["meta"][axis]].append(r["scores"]["needle_accuracy"])
        for value, scores in sorted(groups.items()):
            metrics[f"needle_accuracy_{axis}{value:g}"] = round(fmean(scores), 6)
    kv = [
        r["stats"]["kv_bytes_kept"] / r["stats"]["kv_bytes_full"]
        for r in records
        if r["stats"].get("kv_bytes_full")
    ]
    if kv:
        metrics["kv_kept_share"] = round(fmean(kv), 6)
    metrics["prompt_tokens"] = round(fmean(r["prompt_tokens"] for r in records), 1)
    metrics["kept_tokens"] = round(fmean(r["kept_tokens"] for r in records), 1)
    return metrics


def timings(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per item (decode in ms per token); ``prefill_s`` is the shared prefill."""
    out = {}
    for key in TIMINGS:
        value = _mean([r["stats"].get(key) for r in records])
        if value is not None:
            out[key] = value
    return out


def versus(
    group: Sequence[dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """Paired comparison of one run with the baseline press at the same budget.

    ``baseline`` maps item id -> the baseline's record. Returns the number of paired items,
    the ratio of mean KLs (None when the baseline's is 0), and per-item counts of lower /
    higher KL and of accuracy and agreement won / lost, each with its exact two-sided
    sign-test p-value (``*_sign_p``, ties left out); None when no item pairs.
    """
    pairs = [
        (r["scores"], baseline[r["item_id"]]["scores"]) for r in group if r["item_id"] in baseline
    ]
    if not pairs:
        return None
    out: dict[str, Any] = {"n": len(pairs)}
    kls = [
        (s["kl"], b["kl"]) for s, b in pairs if s.get("kl") is not None and b.get("kl") is not None
    ]
    if kls:
        base_kl = fmean(b for _, b in kls)
        out["kl_ratio"] = round(fmean(s for s, _ in kls) / base_kl, 6) if base_kl else None
        out["kl_lower"] = sum(s < b for s, b in kls)
        out["kl_higher"] = sum(s > b for s, b in kls)
        out["kl_sign_p"] = sign_test(out["kl_lower"], out["kl_higher"])
    for key in ("accuracy", "agreement"):
        scored = [
            (s[key], b[key]) for s, b in pairs if s.get(key) is not None and b.get(key) is not None
        ]
        if scored:
            out[f"{key}_won"] = sum(s > b for s, b in scored)
            out[f"{key}_lost"] = sum(s < b for s, b in scored)
            out[f"{key}_sign_p"] = sign_test(out[f"{key}_won"], out[f"{key}_lost"])
    return out


def intervals(records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Bootstrap 95% intervals over items of the :data:`CI_SCORES` means."""
    out = {}
    for key in CI_SCORES:
        ci = bootstrap_ci([r["scores"][key] for r in records if r["scores"].get(key) is not None])
        if ci is not None:
            out[key] = list(ci)
    return out


def build_runs(
    records: Sequence[dict[str, Any]],
    points: Sequence[tuple[str, float | None]],
    baseline: str = "snapkv",
) -> list[dict[str, Any]]:
    """One run per (press, budget) in ``points`` order that has records.

    Retention divides each score by the full cache's score over the same items (None when
    the full cache scores 0 there). When ``baseline`` ran too, every other compressed run
    gets ``versus``: a paired comparison with it at the same budget (:func:`versus`).
    """
    by_point: dict[tuple[str, float | None], list[dict[str, Any]]] = defaultdict(list)
    full_by_item: dict[str, dict[str, Any]] = {}
    baseline_by_budget: dict[float | None, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        by_point[(r["press"], r.get("budget"))].append(r)
        if r["press"] == "full":
            full_by_item[r["item_id"]] = r
        elif r["press"] == baseline:
            baseline_by_budget[r.get("budget")][r["item_id"]] = r
    runs = []
    for press, budget in points:
        group = sorted(by_point.get((press, budget), []), key=lambda r: r["item_id"])
        if not group:
            continue
        metrics = summarize(group)
        reference = (
            summarize([full_by_item[r["item_id"]] for r in group if r["item_id"] in full_by_item])
            if any(r["item_id"] in full_by_item for r in group)
            else {}
        )
        retention = {}
        for key in RETAINED:
            if key in metrics:
                base = reference.get(key)
                retention[key] = round(metrics[key] / base, 6) if base else None
        run = {
            "press": press,
            "budget": budget,
            "n": len(group),
            "metrics": metrics,
            "ci": intervals(group),
            "retention": retention,
            "timings": timings(group),
        }
        if press not in ("full", baseline):
            paired = versus(group, baseline_by_budget.get(budget, {}))
            if paired is not None:
                run["versus"] = {"baseline": baseline, **paired}
        runs.append(run)
    return runs


def needle_grid(
    records: Sequence[dict[str, Any]],
) -> dict[tuple[str, int | None], dict[tuple[int, float], float]]:
    """Needle accuracy per (press, budget) and (length, depth) cell."""
    cells: dict[tuple[str, int | None], dict[tuple[int, float], list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in records:
        if r["type"] == "needle" and "length" in r["meta"]:
            cells[(r["press"], r.get("budget"))][(r["meta"]["length"], r["meta"]["depth"])].append(
                r["scores"]["needle_accuracy"]
            )
    return {point: {cell: fmean(v) for cell, v in grid.items()} for point, grid in cells.items()}
