"""Writing the results: metrics.json, report.md and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragsnap.eval.items import Malformed
from ragsnap.eval.plots import HEADLINE, budget_label, plot_needles, plot_scores
from ragsnap.eval.questions import question_section

__all__ = [
    "HEADLINE",
    "budget_label",
    "plot_needles",
    "plot_scores",
    "write_malformed",
    "write_metrics",
    "write_report",
]

# report.md columns, in order; a column is shown when some run has the metric
COLUMNS = (
    ("accuracy", "accuracy"),
    ("yesno_accuracy", "yes/no acc"),
    ("yesno_macro_f1", "yes/no F1"),
    ("factoid_strict", "factoid strict"),
    ("factoid_lenient", "factoid lenient"),
    ("factoid_mrr", "factoid MRR"),
    ("list_f1", "list F1"),
    ("rouge_l", "ROUGE-L"),
    ("needle_accuracy", "needle acc"),
    ("needle_partial", "needle digits"),
    ("agreement", "agreement"),
    ("kl", "KL"),
    ("nll_gap", "NLL gap"),
    ("citation_precision", "cite P"),
    ("citation_recall", "cite R"),
    ("gold_kept_share", "gold kept"),
    ("needle_kept_share", "needle kept"),
)


def fmt(value: Any) -> str:
    """How report.md prints a number: three decimals, '-' when absent."""
    return "-" if value is None else f"{value:.3f}"


def write_metrics(out_dir: Path, runs: list[dict[str, Any]]) -> Path:
    path = out_dir / "metrics.json"
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n", encoding="utf-8")
    return path


def write_malformed(out_dir: Path, malformed: Sequence[Malformed]) -> None:
    path = out_dir / "malformed.json"
    path.write_text(json.dumps([m.to_dict() for m in malformed], indent=2) + "\n", encoding="utf-8")


def _table(
    runs: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], source: str
) -> list[str]:
    header = "| press | budget | n | " + " | ".join(label for _, label in columns) + " |"
    lines = [header, "|" + "---|" * (3 + len(columns))]
    for run in runs:
        values = run[source]
        cells = [fmt(values.get(key)) for key, _ in columns]
        lines.append(
            f"| {run['press']} | {budget_label(run['budget'])} | {run['n']} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _pair(values: dict[str, Any], first: str, second: str, p: str) -> str:
    if first not in values:
        return "-"
    pvalue = values.get(p)
    shown = "" if pvalue is None else f" (p {pvalue:.3g})"
    return f"{values[first]} / {values[second]}{shown}"


def _versus_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Paired comparison with the baseline press at the same budget (empty when none ran)."""
    paired = [r for r in runs if "versus" in r]
    if not paired:
        return []
    baseline = paired[0]["versus"]["baseline"]
    lines = [
        f"## Against {baseline} at the same budget (paired items)",
        "",
        "Counts are items; p is the exact two-sided sign test over the items that differ "
        "(ties left out; on accuracy, the exact McNemar test).",
        "",
        "| press | budget | n | KL ratio | KL lower / higher (p) | accuracy won / lost (p) "
        "| agreement won / lost (p) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in paired:
        v = run["versus"]
        lines.append(
            f"| {run['press']} | {budget_label(run['budget'])} | {v['n']} | "
            f"{fmt(v.get('kl_ratio'))} | {_pair(v, 'kl_lower', 'kl_higher', 'kl_sign_p')} "
            f"| {_pair(v, 'accuracy_won', 'accuracy_lost', 'accuracy_sign_p')} "
            f"| {_pair(v, 'agreement_won', 'agreement_lost', 'agreement_sign_p')} |"
        )
    return lines + [""]


def _interval_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Mean and bootstrap 95% interval of the scores that have intervals."""
    keys = [k for k, _ in COLUMNS if any(k in r.get("ci", {}) for r in runs)]
    if not keys:
        return []
    labels = dict(COLUMNS)
    lines = [
        "## 95% intervals (bootstrap over items, 1000 resamples, seed 0)",
        "",
        "| press | budget | n | " + " | ".join(labels[k] for k in keys) + " |",
        "|" + "---|" * (3 + len(keys)),
    ]
    for run in runs:
        cells = []
        for key in keys:
            ci = run.get("ci", {}).get(key)
            mean = fmt(run["metrics"].get(key))
            cells.append(f"{mean} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else mean)
        lines.append(
            f"| {run['press']} | {budget_label(run['budget'])} | {run['n']} | "
            + " | ".join(cells)
            + " |"
        )
    return lines + [""]


def write_report(
    out_dir: Path,
    runs: list[dict[str, Any]],
    records: Sequence[dict[str, Any]],
    header: dict[str, Any],
    malformed: Sequence[Malformed],
    plots: Sequence[str],
) -> Path:
    """``report.md``: settings, the metrics table with 95% intervals, retention, needles by
    length, the paired comparison with the baseline press, timings, plots, and the first
    items' answers with their scores and why (all items: ``questions.md``)."""
    lines = ["# ragsnap eval report", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    items = len({r["item_id"] for r in records})
    lines += [f"- items scored: {items}", f"- malformed items skipped: {len(malformed)}", ""]
    columns = [(k, label) for k, label in COLUMNS if any(k in r["metrics"] for r in runs)]
    lines += ["## Metrics", ""] + _table(runs, columns, "metrics") + [""]
    lines += _interval_table(runs)
    kept = [
        (k, label) for k, label in COLUMNS if any(r["retention"].get(k) is not None for r in runs)
    ]
    if kept:
        lines += ["## Retention (metric / full-cache metric on the same items)", ""]
        lines += _table(runs, kept, "retention") + [""]
    lengths = sorted(
        {
            key[len("needle_accuracy_length") :]
            for r in runs
            for key in r["metrics"]
            if key.startswith("needle_accuracy_length")
        },
        key=float,
    )
    if lengths:
        cols = [(f"needle_accuracy_length{n}", f"{n} tokens") for n in lengths]
        lines += ["## Needle accuracy by prompt length", ""] + _table(runs, cols, "metrics") + [""]
    lines += _versus_table(runs)
    timing_cols = [
        ("prefill_s", "prefill s (shared)"),
        ("compress_s", "compress s"),
        ("decode_ms_per_token", "decode ms/token"),
        ("fidelity_s", "teacher forcing s"),
    ]
    lines += ["## Timings (mean per item)", ""] + _table(runs, timing_cols, "timings") + [""]
    if malformed:
        lines += ["## Malformed items (skipped)", ""]
        lines += [f"- {m.where}: {m.reason}" for m in malformed[:50]]
        if len(malformed) > 50:
            lines.append(f"- ... and {len(malformed) - 50} more (malformed.json)")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += question_section(out_dir, records)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
